"""A calibration whose gradients are not finite is not read (acgc).

fp16 training's GradScaler scales the loss up for backward; when a step overflows, the
unscaled ``.grad`` holds inf or NaN and the scaler skips the optimizer step, lowering the
scale for the next one. Read as a measurement, that inf sent κ to inf and the next
calibration's allocation divided by zero: the fit crashed where plain training goes on.
The policy now logs ``nonfinite`` and keeps its model and settings for such a step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch import nn

from lightning_acgc import ActivationCompression
from lightning_acgc.engine import ActivationCompressor, EngineSettings
from lightning_acgc.engine.cycle import CalibrationCycle
from lightning_acgc.policies import build_policy
from tests._lightning_models import TinyMLP, fit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def _calibrate(steps: int, spoil: dict[int, str]) -> tuple[list[dict], list[float], object]:
    """``steps`` calibrations of acgc driven as the adapter drives them; on the steps of
    ``spoil``: ``"grad inf"``/``"grad nan"`` write that into ``.grad`` after backward (an
    overflowed scaled backward), ``"exact"`` makes the exact pass's loss inf, ``"input"``
    puts an inf into the batch (a saved activation holding inf). Returns each step's
    metrics, κ after it, and the policy."""
    model = _model()
    policy = build_policy("acgc", gradient_error=0.1, warmup_steps=steps)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    policy.setup(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
    metrics, kappas = [], []
    try:
        cycle = CalibrationCycle(engine)
        for step in range(steps):
            how = spoil.get(step)
            batch = x.clone()
            if how == "input":
                batch[0, 0] = math.inf

            def loss(
                exact: bool = False, batch: torch.Tensor = batch, how: str | None = how
            ) -> torch.Tensor:
                value = F.cross_entropy(model(batch), y)
                return value * math.inf if exact and how == "exact" else value

            model.zero_grad()
            assert cycle.begin(step)
            cycle.add_exact_gradient(model, lambda: loss(exact=True))
            cycle.add_probes(model, loss)
            engine.new_step(step)
            with engine.scope():
                value = loss()
            value.backward()
            if how in ("grad inf", "grad nan"):
                model[0].weight.grad[0, 0] = math.inf if how == "grad inf" else math.nan
            cycle.end(model)
            metrics.append(policy.metrics())
            kappas.append(policy.kappa)
    finally:
        engine.remove()
    return metrics, kappas, policy


@pytest.mark.parametrize("how", ["grad inf", "grad nan", "exact", "input"])
def test_a_calibration_that_overflowed_is_not_read(how: str) -> None:
    metrics, kappas, policy = _calibrate(5, {2: how})
    assert metrics[2].get("nonfinite") == 1.0 and "grad_error" not in metrics[2]
    assert kappas[2] == kappas[1]  # nothing read: κ as it was
    assert all(math.isfinite(k) and k > 0 for k in kappas)
    for step in (3, 4):  # the next calibrations read as usual
        assert "nonfinite" not in metrics[step]
        assert 0 < metrics[step]["grad_error"] <= 0.1
    tables = [v for table in policy._variances.values() for v in table]
    assert tables and not any(math.isnan(v) for v in tables)  # (+inf: a width never chosen)
    assert all(math.isfinite(v) for v in policy._nonzero.values())


class _SkippingSGD(torch.optim.SGD):
    """SGD that skips a step whose gradients are not finite, as a GradScaler does."""

    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        grads = [
            p.grad for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        if all(torch.isfinite(g).all() for g in grads):
            super().step()
        return loss


class _Overflowing(TinyMLP):
    """A model whose backward overflows on the given steps (inf in one gradient)."""

    def __init__(self, overflow_at: tuple[int, ...]) -> None:
        super().__init__()
        self.overflow_at = overflow_at

    def on_after_backward(self) -> None:
        if self.global_step in self.overflow_at and not getattr(self, "acgc_calibrating", False):
            self.net[0].weight.grad[0, 0] = math.inf

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _SkippingSGD(self.parameters(), lr=0.1)


class _Metrics(Callback):
    def __init__(self, cb: ActivationCompression) -> None:
        self.cb, self.steps = cb, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(self.cb.policy.metrics())


def test_a_fit_goes_on_through_overflowed_calibrations() -> None:
    """Through the callback: steps 0 and 1 overflow (two of the three warm-up
    calibrations), the fit goes on, the third calibration reads its error within e."""
    cb = ActivationCompression("acgc", gradient_error=0.1, min_numel=0, print_table=False)
    record = _Metrics(cb)
    model = _Overflowing(overflow_at=(0, 1))
    trainer = fit(model, [cb, record], max_steps=4, max_epochs=-1)
    assert trainer.global_step == 4
    assert [m.get("nonfinite") for m in record.steps[:3]] == [1.0, 1.0, None]
    assert 0 < record.steps[2]["grad_error"] <= 0.1
    assert math.isfinite(cb.policy.kappa)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _SmallLoss(TinyMLP):
    """A loss 10⁴ times smaller than the cross-entropy: unscaled, an fp16 backward loses
    most of its output gradients (below float16's range)."""

    def __init__(self) -> None:
        super().__init__(hidden=512, samples=256, batch_size=64)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        return super().training_step(batch, batch_idx) * 1e-4


def test_fp16_with_a_grad_scaler_calibrates_at_the_step_s_loss_scale() -> None:
    """fp16 mixed precision with Lightning's GradScaler (on the CPU through an explicit
    plugin): the calibration's passes run at the scaler's loss scale and are unscaled, as
    the step's own backward. Unscaled they underflowed: κ 796, the worst layer measured at
    0.48 (e = 0.05) and nothing was compressed (1.13x)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_acgc.lightning.driver import loss_scale

    cb = ActivationCompression("acgc", min_numel=0, print_table=False)
    record = _Metrics(cb)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = fit(_SmallLoss(), [cb, record], max_steps=4, max_epochs=-1, plugins=[plugin])
    assert loss_scale(trainer) > 1
    calibrations = [m for m in record.steps[:3] if "grad_error" in m]
    assert len(calibrations) == 3
    assert all(m["layer_grad_error"] <= 0.05 for m in calibrations)
    assert 0.1 < cb.policy.kappa < 10
    assert cb.stats.ratio > 3


def test_fp16_cheap_mode_reads_the_step_s_own_pass_unscaled() -> None:
    """With ``verify=False`` the statistics come from the step's own backward, which ran
    at the GradScaler's loss scale: read as recorded, every output gradient counted
    scale² too large and every tensor was kept at 16 bits (1.13x; 4.34x unscaled, as in
    float32 and with ``verify=True``)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_acgc.lightning.driver import loss_scale

    ratios = {}
    for precision in ("16-mixed", "32"):
        cb = ActivationCompression("acgc", min_numel=0, print_table=False, verify=False)
        scaler = torch.amp.GradScaler("cpu")
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)] if precision != "32" else []
        trainer = fit(_SmallLoss(), [cb], max_steps=4, max_epochs=-1, plugins=plugins)
        assert (loss_scale(trainer) > 1) == (precision != "32")
        ratios[precision] = cb.stats.ratio
        assert max(int(b) for b in cb.policy.site_bits.values()) < 16, precision
    assert ratios["16-mixed"] > 3


def test_a_calibration_that_overflowed_is_run_again_on_the_next_step() -> None:
    """The warm-up's three calibrations and the step after them overflow: step 4, off
    the schedule (``calibrate_every=100``), calibrates again and is read. Overflowing on
    every step, the retries stop after ``MAX_RETRIES`` in a row past the warm-up."""
    from lightning_acgc.policies.calibrating import MAX_RETRIES

    cb = ActivationCompression("acgc", gradient_error=0.1, min_numel=0, print_table=False)
    record = _Metrics(cb)
    fit(_Overflowing(overflow_at=(0, 1, 2, 3)), [cb, record], max_steps=6, max_epochs=-1)
    assert [m.get("nonfinite") for m in record.steps[:4]] == [1.0] * 4
    assert 0 < record.steps[4]["grad_error"] <= 0.1 and "grad_error" not in record.steps[5]

    cb = ActivationCompression("acgc", gradient_error=0.1, min_numel=0, print_table=False)
    record = _Metrics(cb)
    steps = MAX_RETRIES + 6
    model = _Overflowing(overflow_at=tuple(range(steps)))
    fit(model, [cb, record], max_steps=steps, max_epochs=-1)
    calibrated = [i for i, m in enumerate(record.steps) if m.get("nonfinite")]
    assert calibrated == list(range(3 + MAX_RETRIES))  # warm-up steps 0-2, then retries
