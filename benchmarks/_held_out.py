"""acgc's promise on ordinary steps: the settings in force measured on a step that did not
calibrate them.

A calibration measures the settings it allocated on its own batch, so its reading is not
a sample of the steps that follow. :class:`HeldOutCheck` measures those: on the first step
after each calibration it takes the exact gradient of the step's batch before the step
runs (hooks paused, random state and buffers restored: the step draws the same dropout
masks) and, after the step's compressed backward, reads ‖ĝ − g‖/‖g‖ and each module's
‖ĝ_m − g_m‖ against its bound as the calibration does (the policy's ``layer_uses``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_acgc.engine.cycle import exact_gradients
from lightning_acgc.lightning._loop import step_loss
from lightning_acgc.policies._acgc_stats import per_module_sq, per_module_sq_diff

__all__ = ["HeldOutCheck", "held_out_uses"]


def held_out_uses(
    policy: Any, exact: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """(global error over e, the worst module's error over its bound) of ``grads`` against
    ``exact``, the bounds as ``policy`` (an ``ACGCPolicy``) holds them on calibrations.

    Example:
        >>> from lightning_acgc.policies import ACGCPolicy
        >>> exact = {"a.weight": torch.ones(4), "b.weight": torch.ones(4)}
        >>> grads = {"a.weight": torch.ones(4) * 1.1, "b.weight": torch.ones(4)}
        >>> [round(u, 3) for u in held_out_uses(ACGCPolicy(gradient_error=0.1), exact, grads)]
        [0.707, 1.0]
    """
    module_g = per_module_sq(exact)
    module_err = per_module_sq_diff(grads, exact)
    g_sq = sum(module_g.values())
    if g_sq <= 0:
        return 0.0, 0.0
    layer = max(policy.layer_uses(module_g, module_err, g_sq).values(), default=0.0)
    return (sum(module_err.values()) / g_sq) ** 0.5 / policy.error_target, layer**0.5


class HeldOutCheck(pl.Callback):
    """After ``ActivationCompression`` in the callbacks: on the first step after each
    verified calibration, the promise of the settings in force (:func:`held_out_uses`),
    appended to :attr:`readings` as (global use, layer use). Made for the fits of
    ``benchmarks/promise.py`` (one process); with gradient accumulation it reads nothing."""

    def __init__(self, compression: Any) -> None:
        self.compression = compression
        self.readings: list[tuple[float, float]] = []
        self._exact: dict[str, torch.Tensor] | None = None
        self._calibrated = False

    @property
    def policy(self) -> Any:
        return self.compression.policy

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._exact = None
        step = trainer.global_step
        if not self._calibrated or self.policy.is_calibration_step(step):
            return
        if trainer.accumulate_grad_batches != 1:
            return  # .grad would sum several batches against one batch's exact gradient
        engine = self.compression.engine
        loss = step_loss(trainer, pl_module, batch, batch_idx)
        self._exact = exact_gradients(engine, pl_module, loss)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._exact is None:
            return
        grads = {
            n: p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            for n, p in pl_module.named_parameters()
            if n in self._exact
        }
        self.readings.append(held_out_uses(self.policy, self._exact, grads))
        self._exact = None
        self._calibrated = False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if "grad_error" in self.policy.metrics():
            self._calibrated = True  # this step calibrated: check the next one
