"""acgc's rehearsals: a calibration's settings tried on its own batch before they train,
patched where they break the promise (:mod:`lightning_acgc.policies.acgc_rehearsal`)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch import nn

from lightning_acgc import ActivationCompression
from lightning_acgc.engine import ActivationCompressor, EngineSettings, compressed_step
from lightning_acgc.policies import ACGCPolicy, build_policy
from tests._lightning_models import TinyMLP, fit
from tests.test_acgc_quant import _deep_mlp, _digits


def test_rehearsals_option_is_checked_and_off_by_default() -> None:
    assert ACGCPolicy().rehearsals == 0
    assert build_policy("acgc", rehearsals=3).rehearsals == 3
    assert ACGCPolicy.rehearsals == 0  # the option sets the instance's, not the class's
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"rehearsals={bad!r} must be an int >= 0"):
            ACGCPolicy(rehearsals=bad)


def _loose_calibration(rehearsals: int, e: float = 0.05) -> dict[str, float]:
    """The deep MLP calibrated every step; before step 4 the rounding variance tables are
    made 10⁴x too small (the model believes every width 100x more precise than it is), so
    that step's allocation is far too loose. The step's metrics."""
    model = _deep_mlp()
    policy = build_policy("acgc", gradient_error=e, calibrate_every=1, rehearsals=rehearsals)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=256))
    engine.install()
    policy.setup(model)
    try:
        for step in range(5):
            x, y = _digits(step)
            if step == 4:
                policy._variances = {
                    k: [v * 1e-4 for v in table] for k, table in policy._variances.items()
                }
            model.zero_grad()
            compressed_step(engine, model, lambda: nn.functional.cross_entropy(model(x), y), step)
        return policy.metrics()
    finally:
        engine.remove()
        policy.teardown()


def test_a_rehearsal_that_breaks_the_promise_patches_the_settings_before_they_train() -> None:
    """Without rehearsals the loose allocation trains and the calibration measures it far
    over e; with them, the first pass measures the same break (``rehearsal_error``), the
    floors it sets bring the step's own pass within the promise, and cost bits."""
    e = 0.05
    plain = _loose_calibration(0, e)
    assert plain["grad_error"] > e or plain["layer_budget_use"] > 1, plain
    assert "rehearsals" not in plain
    patched = _loose_calibration(4, e)
    assert patched["rehearsal_error"] == pytest.approx(plain["grad_error"], rel=1e-6)
    assert patched["rehearsal_fixes"] >= 1, patched
    assert patched["grad_error"] <= e and patched["layer_budget_use"] <= 1, patched
    assert patched["avg_bits"] > plain["avg_bits"], (patched, plain)


def test_floors_of_a_rehearsal_last_until_the_next_calibration() -> None:
    policy = ACGCPolicy(calibrate_every=2, warmup_steps=1, rehearsals=1)
    policy._rehearsal_floors = {"fc:0": 8}
    assert policy.floors()["fc:0"] == 8
    policy.begin_step(3)  # not a calibration: the settings in force keep their floors
    assert policy.floors()["fc:0"] == 8
    policy.begin_step(4)
    assert "fc:0" not in policy.floors()


class _Readings(Callback):
    def __init__(self, policy: ACGCPolicy) -> None:
        self.policy = policy
        self.readings: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        m = self.policy.metrics()
        if "grad_error" in m:
            self.readings.append(m)


def test_in_a_fit_a_rehearsal_is_the_steps_own_pass_again() -> None:
    """Under Lightning the rehearsal runs as the step's own pass will (its engine step, so
    its rounding seeds; its batch held as it is), dropout masks restored: where no
    rehearsal broke, its reading is the step's measured error to the last digit."""
    torch.manual_seed(0)
    callback = ActivationCompression(
        policy="acgc", calibrate_every=2, rehearsals=2, min_numel=0, print_table=False
    )
    readings = _Readings(callback.policy)
    fit(TinyMLP(dropout=0.2, samples=192), callbacks=[callback, readings])
    rehearsed = [m for m in readings.readings if "rehearsals" in m]
    assert len(rehearsed) >= 3, readings.readings
    for m in rehearsed:
        if not m.get("rehearsal_fixes"):
            assert m["rehearsal_error"] == pytest.approx(m["grad_error"], rel=1e-9, abs=0)
            assert m["rehearsal_layer_use"] == pytest.approx(m["layer_budget_use"], rel=1e-9)
