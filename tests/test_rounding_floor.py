"""acgc under 16-bit precision: the floor pass (lightning_acgc.policies.acgc_rounding).

A 16-bit backward moves the gradient by its own rounding noise whenever a saved tensor
changes at all; acgc measures that floor with every lossy tensor moved by one ulp and reads
its errors beyond it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import ActivationCompression, ActivationCompressor, compressed_step
from lightning_acgc.engine.cycle import exact_gradients
from lightning_acgc.policies import build_policy
from lightning_acgc.policies.acgc import ACGCPolicy
from lightning_acgc.policies.acgc_rounding import UlpJitter
from tests._lightning_models import fit
from tests.test_autocast import ConvBN, _images
from tests.test_unusual_models import Classifier

SIXTEEN = [torch.bfloat16, torch.float16]


def _adversarial(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    special = [0.0, -0.0, info.max, -info.max, info.tiny, info.tiny / 4, -info.tiny / 2]
    special += [float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 3.0]
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(special), torch.randn(2000, generator=g) * 100])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_ulp_jitter_moves_every_finite_nonzero_value_by_one_ulp(dtype: torch.dtype) -> None:
    x = _adversarial(dtype)
    y = UlpJitter().decode(UlpJitter().encode(x, seed=3))
    assert y.dtype == dtype and y.shape == x.shape
    moved = (x != 0) & torch.isfinite(x)
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    down = torch.nextafter(x, torch.full_like(x, float("-inf")))
    assert bool(((y == up) | (y == down))[moved].all())
    assert 0.4 < (y == up)[moved].float().mean().item() < 0.6  # either way, at random
    kept = ~moved & ~torch.isnan(x)
    assert torch.equal(y[kept], x[kept])  # zeros and ±inf as they were
    assert bool(torch.isnan(y[torch.isnan(x)]).all())
    again = UlpJitter().decode(UlpJitter().encode(x, seed=3))
    assert torch.equal(again[~torch.isnan(x)], y[~torch.isnan(x)])  # decoded again alike


@pytest.mark.parametrize("shape", [(0,), (), (3, 0)])
def test_ulp_jitter_takes_empty_and_zero_dimensional_tensors(shape: tuple[int, ...]) -> None:
    x = torch.full(shape, 2.0, dtype=torch.bfloat16)
    y = UlpJitter().decode(UlpJitter().encode(x, seed=0))
    assert y.shape == x.shape
    assert bool(((y - x).abs() > 0).all())


def test_ulp_jitter_of_a_non_contiguous_view() -> None:
    x = torch.randn(8, 6).to(torch.bfloat16).t()[1:]
    y = UlpJitter().decode(UlpJitter().encode(x, seed=1))
    assert y.shape == x.shape and bool((y != x).all())


def test_errors_are_read_beyond_the_floor() -> None:
    policy = ACGCPolicy()
    assert policy.beyond_floor({"a": 3.0, "b": 2.0}, 4.0) == {"a": 3.0, "b": 2.0}
    assert "rounding_floor" not in policy.metrics()  # no floor measured: as measured
    policy._floor_sq = {"a": 1.0, "b": 4.0}
    assert policy.beyond_floor({"a": 3.0, "b": 2.0}, 4.0) == {"a": 2.0, "b": 0.0}
    assert policy.metrics()["rounding_floor"] == pytest.approx(math.sqrt(5 / 4))


def test_rounding_floor_option_is_checked() -> None:
    with pytest.raises(ValueError, match="rounding_floor='yes' must be True or False"):
        ACGCPolicy(rounding_floor="yes")  # type: ignore[arg-type]
    assert build_policy("acgc", rounding_floor=False).rounding_floor is False


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def _steps(precision: str, steps: int, **options: object) -> tuple[list[dict], list[int], float]:
    """``steps`` calibrating steps of acgc on :func:`_net`: each step's metrics, the number
    of forwards each step ran, and the last step's ‖ĝ − g‖/‖g‖ measured here."""
    model = _net()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 12, 12, generator=g), torch.randint(0, 10, (16,), generator=g)
    policy = build_policy("acgc", warmup_steps=steps, **options)
    engine = ActivationCompressor(policy, model=model)
    engine.install()
    policy.setup(model)
    calls = [0]

    def loss() -> torch.Tensor:
        calls[0] += 1
        return F.cross_entropy(model(x), y)

    context = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    metrics, forwards, raw = [], [], 0.0
    try:
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            before = calls[0]
            with context:
                exact = exact_gradients(engine, model, loss)  # the step's own, bit for bit
                compressed_step(engine, model, loss, step)
            forwards.append(calls[0] - before - 1)
            metrics.append(policy.metrics())
            num = sum(float((p.grad - exact[n]).pow(2).sum()) for n, p in model.named_parameters())
            raw = math.sqrt(num / sum(float(g.pow(2).sum()) for g in exact.values()))
    finally:
        engine.remove()
    return metrics, forwards, raw


def test_floor_pass_runs_on_16_bit_calibrations_only() -> None:
    metrics, forwards, _ = _steps("fp32", 3)
    assert forwards == [2, 2, 2]  # the exact pass and the compressed one
    assert not any("rounding_floor" in m for m in metrics)
    metrics, forwards, raw = _steps("bf16", 3)
    # the first calibration finds the 16-bit tensors; each later one runs the floor pass
    assert forwards == [2, 3, 3]
    assert "rounding_floor" not in metrics[0]
    floor, error = metrics[-1]["rounding_floor"], metrics[-1]["grad_error"]
    assert 0 < floor < 0.05
    # what is read is the error beyond the floor (per module, at least 0)
    assert error < raw
    assert error**2 >= raw**2 - floor**2 - 1e-9
    metrics, forwards, _ = _steps("bf16", 3, rounding_floor=False)
    assert forwards == [2, 2, 2] and not any("rounding_floor" in m for m in metrics)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_bf16_mixed_fit_logs_the_floor(accumulate: int) -> None:
    """Also with gradient accumulation: the floor pass runs on each step's last batch."""
    cb = ActivationCompression(print_table=False)
    model = Classifier(ConvBN(), data=_images)
    trainer = fit(
        model, [cb], max_steps=3, precision="bf16-mixed", accumulate_grad_batches=accumulate
    )
    logged = trainer.callback_metrics
    assert "acgc/rounding_floor" in logged and 0 < float(logged["acgc/rounding_floor"]) < 0.1
    assert cb.stats.ratio > 1.5


def test_calibrations_within_the_floor_raise_the_first_aim() -> None:
    """Until κ has a reading the allocation aims at ``first_aim`` of the budget. A
    calibration whose error is all within the floor gives no reading; it loosened κ
    alone, which the per-layer budgets do not follow (they never loosen with κ), so a fit
    whose errors stayed under a bf16 backward's noise kept the first aim's widths for
    good (8 bits where one reading brings 6). Each such calibration now raises the aim 4x
    (one width step: a bit is 4x the variance), κ as it was."""
    from tests._lightning_models import TinyMLP

    torch.manual_seed(0)
    cb = ActivationCompression(
        "acgc", min_numel=0, print_table=False, calibrate_every=1, warmup_steps=1
    )
    policy = cb.policy
    policy.beyond_floor = lambda err, g_sq=0.0: dict.fromkeys(err, 0.0)  # all within
    widths, aims, kappas = [], [], []

    class Record(TinyMLP):
        def on_train_batch_end(self, *args: object) -> None:
            widths.append(dict(policy.site_bits))
            aims.append(getattr(policy, "aim", None))
            kappas.append(policy.kappa)

    fit(Record(hidden=512, samples=256, batch_size=64), [cb], max_steps=4, precision="bf16-mixed")
    (key,) = widths[1]  # the ReLU output saved for the second Linear
    first = widths[1][key]
    assert [w[key] for w in widths[1:]] == [first, first - 1, first - 2]
    assert aims[1:] == [4 * ACGCPolicy.first_aim, 16 * ACGCPolicy.first_aim, 1.0]
    assert len(set(kappas[:3])) == 1  # κ kept while the aim climbs
