"""How often the user's ``training_step`` runs: once per batch, plus once per batch of
each step where the policy measures the exact gradient, and those extra calls see
``self.acgc_calibrating`` set (README, "Calibration steps")."""

from __future__ import annotations

import pytest
import torch

from lightning_acgc import ActivationCompression
from tests._lightning_models import TinyMLP, fit


class CountingMLP(TinyMLP):
    """Records, for each ``training_step`` call, whether it was a calibration re-run."""

    def __init__(self) -> None:
        super().__init__(samples=64, batch_size=8)
        self.calls: list[bool] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        self.calls.append(getattr(self, "acgc_calibrating", False))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_step_calls_are_counted_and_flagged(accumulate: int) -> None:
    steps = 12
    model = CountingMLP()
    cb = ActivationCompression(policy="acgc", calibrate_every=5, min_numel=0, print_table=False)
    fit(model, [cb], max_steps=steps, max_epochs=-1, accumulate_grad_batches=accumulate)
    batches = steps * accumulate
    calibrations = sum(cb.policy.needs_exact_gradient(s) for s in range(steps))
    assert 0 < calibrations < steps
    assert model.calls.count(False) == batches
    assert model.calls.count(True) == calibrations * accumulate
    assert len(model.calls) == batches + calibrations * accumulate
    assert len(model.calls) == {1: 17, 2: 34}[accumulate]  # the count README states
    assert "acgc_calibrating" not in model.__dict__  # the flag is gone after each re-run


def test_fixed_policy_never_reruns() -> None:
    model = CountingMLP()
    fit(model, [ActivationCompression(codec="quant", bits=4, print_table=False)], max_steps=6)
    assert model.calls == [False] * 6
