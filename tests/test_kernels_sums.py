"""``squared_sum``: the compiled float64 sums of squares against torch's norm."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_acgc.kernels.common import cpu_lib, sums
from lightning_acgc.kernels.common.sums import squared_sum, squared_sum_ref
from lightning_acgc.policies._acgc_stats import module_norms, per_module_sq_diff

needs_library = pytest.mark.skipif(cpu_lib.cpu_library() is None, reason="no C compiler here")


def _pair(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(numel)
    a = torch.randn(numel, generator=g) * 1e3
    return a, a + torch.randn(numel, generator=g) * 1e-3


@needs_library
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 511, 100003])
def test_matches_torch_within_rounding(numel: int) -> None:
    a, b = _pair(numel)
    for got, want in (
        (squared_sum(a), squared_sum_ref(a)),
        (squared_sum(a, b), squared_sum_ref(a, b)),
    ):
        assert got == pytest.approx(want, rel=1e-12, abs=0.0)


@needs_library
def test_views_dtypes_and_special_values() -> None:
    a, b = _pair(4000)
    m, n = a.view(40, 100).t(), b.view(40, 100).t()  # non-contiguous
    assert squared_sum(m, n) == pytest.approx(squared_sum_ref(m, n), rel=1e-12)
    assert squared_sum(torch.tensor(3.0)) == 9.0  # 0-d
    half = a.to(torch.float16)  # torch's path
    assert squared_sum(half) == squared_sum_ref(half)
    assert squared_sum(a, b.double()) == squared_sum_ref(a, b.double())
    tiny = torch.full((9,), 1e-40)  # denormals: squares that float32 would flush to 0
    assert squared_sum(tiny) == pytest.approx(9 * (1e-40) ** 2, rel=1e-5)
    for bad in (float("nan"), float("inf")):
        c = a.clone()
        c[1234] = bad
        assert math.isnan(squared_sum(c, b)) or math.isinf(squared_sum(c, b))
        assert math.isnan(squared_sum(c)) == math.isnan(bad)


@needs_library
def test_same_sum_for_any_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _pair(1 << 20)
    seen = set()
    for threads in (1, 2, 3):
        monkeypatch.setattr(sums, "cpu_threads", lambda threads=threads: threads)
        seen.add(squared_sum(a, b))
    assert len(seen) == 1


def test_tables_use_it() -> None:
    grads = {"fc.weight": torch.tensor([[1.0, 2.0]]), "fc.bias": torch.tensor([1.0])}
    exact = {"fc.weight": torch.tensor([[1.0, 0.0]]), "fc.bias": torch.tensor([3.0])}
    assert per_module_sq_diff(grads, exact) == {"fc": 8.0}
    model = torch.nn.Linear(2, 1)
    model.weight.grad, model.bias.grad = grads["fc.weight"], grads["fc.bias"]
    renamed = {"weight": exact["fc.weight"], "bias": exact["fc.bias"]}
    assert module_norms(model, renamed) == ({"": 10.0}, {"": 8.0})
