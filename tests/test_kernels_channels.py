"""The compiled CPU path of the per-channel normalization against its torch reference
(:mod:`lightning_acgc.kernels.channels`): equal outputs on adversarial inputs, and the
tensors it leaves to the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_acgc.kernels.channels import normalize_channels, normalize_ref
from lightning_acgc.kernels.channels.cpu import normalize_channels_cpu
from lightning_acgc.kernels.common.cpu_lib import cpu_library

pytestmark = pytest.mark.skipif(cpu_library() is None, reason="no C compiler")

_SPECIALS = (float("nan"), float("inf"), float("-inf"))


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    for left, right in zip(a, b, strict=True):
        assert left.shape == right.shape and left.dtype == right.dtype
        # equal values; a zero's sign may differ (which of min(0, −0) comes first)
        torch.testing.assert_close(left, right, rtol=0, atol=0, equal_nan=True)


@st.composite
def channel_tensors(draw: st.DrawFn) -> torch.Tensor:
    """Float32 tensors of 2-4 dims whose channels differ in scale and kind: ordinary,
    constant, tiny (half range under 1e-30), huge (near float32's max), subnormal, and
    channels holding NaN or ±inf."""
    dims = draw(st.integers(2, 4))
    shape = [draw(st.integers(1, 5)), draw(st.integers(1, 12))]
    shape += [draw(st.integers(1, 9)) for _ in range(dims - 2)]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(shape, generator=gen)
    for c in range(shape[1]):
        kind = draw(st.sampled_from(["plain", "const", "tiny", "huge", "subnormal", "special"]))
        ch = x[:, c]
        if kind == "const":
            ch.fill_(draw(st.sampled_from([0.0, -0.0, 7.25, -3e38])))
        elif kind == "tiny":
            ch.mul_(1e-36).add_(1e-33)
        elif kind == "huge":
            ch.mul_(1.7e38).clamp_(-3.4e38, 3.4e38)
        elif kind == "subnormal":
            ch.mul_(1e-40)
        elif kind == "special":
            at = torch.unravel_index(torch.tensor(draw(st.integers(0, ch.numel() - 1))), ch.shape)
            ch[tuple(int(i) for i in at)] = draw(st.sampled_from(_SPECIALS))
        else:
            ch.mul_(draw(st.sampled_from([1e-3, 1.0, 1e3]))).relu_()
    return x


@settings(max_examples=150, deadline=None)
@given(x=channel_tensors())
def test_cpu_path_equals_the_reference(x: torch.Tensor) -> None:
    _same(normalize_channels_cpu(x), normalize_ref(x))
    _same(normalize_channels(x), normalize_ref(x))  # "auto" takes the CPU path here


def test_large_tensor_runs_threaded_and_equal() -> None:
    x = torch.randn(16, 48, 20, 20) * torch.logspace(-4, 4, 48).view(1, 48, 1, 1)
    x[3, 7, 2, 2] = float("nan")
    _same(normalize_channels_cpu(x), normalize_ref(x))


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(4, 6, 5).to(torch.bfloat16),
        torch.randn(4, 6, 5).half(),
        torch.randn(4, 6, 5, 3).contiguous(memory_format=torch.channels_last),
        torch.randn(6, 4).t(),
    ],
    ids=["bf16", "fp16", "channels_last", "transposed"],
)
def test_other_tensors_go_to_the_reference(x: torch.Tensor) -> None:
    _same(normalize_channels_cpu(x), normalize_ref(x))


def test_backend_torch_forces_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_acgc.kernels.channels.cpu as cpu

    def fail() -> None:
        raise AssertionError("the C path ran")

    monkeypatch.setattr(cpu, "cpu_library", fail)
    x = torch.randn(2, 3, 4)
    _same(normalize_channels(x, backend="torch"), normalize_ref(x))
    with pytest.raises(AssertionError, match="the C path ran"):
        normalize_channels(x)


# --- Triton (under TRITON_INTERPRET=1 here; on the GPU with the gpu mark) ----------------


@settings(max_examples=60, deadline=None)
@given(x=channel_tensors(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_triton_path_equals_the_reference(x: torch.Tensor, dtype: torch.dtype) -> None:
    from lightning_acgc.kernels.channels.triton import normalize_channels_triton

    x = x.to(dtype)
    _same(normalize_channels_triton(x), normalize_ref(x))
    _same(normalize_channels(x, backend="triton"), normalize_ref(x))


def test_triton_route_leaves_strided_tensors_to_the_reference() -> None:
    x = torch.randn(4, 6, 5, 3).contiguous(memory_format=torch.channels_last)
    _same(normalize_channels(x, backend="triton"), normalize_ref(x))


def test_triton_argument_errors() -> None:
    from lightning_acgc.kernels.channels.triton import normalize_channels_triton

    with pytest.raises(TypeError, match="dtype"):
        normalize_channels_triton(torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        normalize_channels_triton(torch.randn(3, 2).t())
    with pytest.raises(ValueError, match="two dimensions"):
        normalize_channels_triton(torch.randn(5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_equals_the_reference_on_gpu(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 40, 9, 9, generator=gen) * torch.logspace(-4, 4, 40).view(1, 40, 1, 1)
    x[:, 3] = 2.5
    x[:, 5] *= 1e-36
    x[1, 7, 0, 0] = float("nan")
    x[2, 9, 1, 1] = float("-inf")
    x = x.to(dtype).cuda()
    _same(normalize_channels(x), normalize_ref(x))
