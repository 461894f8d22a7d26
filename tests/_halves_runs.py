"""A calibrating run of an acgc policy whose loss comes with the loss of each half of its
batch (the noise-relative budget's tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_acgc.engine import ActivationCompressor, EngineSettings, compressed_step

Loss = Callable[[], torch.Tensor]


def run_with_halves(
    model: nn.Module,
    policy,
    steps: int,
    losses: Callable[[int], tuple[Loss, tuple[Loss, Loss] | None]],
) -> list[dict[str, float]]:
    """Train nothing, calibrate every step: ``losses(step)`` gives the step's loss and the
    losses of its halves (or ``None``). Returns the policy's metrics per step."""
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    policy.setup(model)
    history = []
    try:
        for step in range(steps):
            loss, halves = losses(step)
            model.zero_grad()
            compressed_step(engine, model, loss, step, loss_halves=halves)
            history.append(policy.metrics())
    finally:
        engine.remove()
    return history
