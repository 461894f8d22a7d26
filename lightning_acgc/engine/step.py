"""One compressed training step with the policy's calibration cycle, for plain PyTorch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_acgc.engine.compressor import ActivationCompressor
from lightning_acgc.engine.cycle import CalibrationCycle, no_reduce
from lightning_acgc.engine.policy import Reduce

__all__ = ["compressed_step"]


def compressed_step(
    engine: ActivationCompressor,
    model: nn.Module,
    compute_loss: Callable[[], torch.Tensor],
    step: int,
    reduce: Reduce = no_reduce,
    loss_halves: tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]] | None = None,
    inputs: Any = None,
) -> torch.Tensor:
    """Forward and backward of one step under compression; the optimizer step is yours.

    Args:
        engine: an installed :class:`ActivationCompressor`.
        model: the model (its parameters receive ``.grad``).
        compute_loss: runs the forward and returns the loss.
        step: global step (drives the policy's calibration schedule and seeds).
        reduce: averages a tensor over data-parallel ranks.
        loss_halves: the loss on each half of the batch, for a policy with a noise-relative
            budget (``needs_noise_estimate``); their exact gradients are passed on.
        inputs: the step's batch (tensors nested in lists, dicts, ...), which the caller
            holds until the step ends: saved as it is, counted as neither saved nor kept
            (:mod:`~lightning_acgc.engine.step_inputs`).

    Example:
        >>> from lightning_acgc.engine.settings import EngineSettings
        >>> from lightning_acgc.policies import build_policy
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        >>> policy = build_policy("acgc", gradient_error=0.05)
        >>> engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
        >>> engine.install(); policy.setup(model)
        >>> x = torch.randn(64, 32)
        >>> loss = compressed_step(engine, model, lambda: model(x).square().mean(), step=0)
        >>> policy.metrics()["grad_error"] < 0.05
        True
        >>> engine.remove()
    """
    cycle = CalibrationCycle(engine, reduce)
    engine.new_step(step)
    engine.inputs.hold(inputs)
    wants_exact = cycle.begin(step)
    if loss_halves is not None:
        cycle.add_noise_estimate(model, loss_halves)
    if wants_exact:
        cycle.add_exact_gradient(model, compute_loss)
        cycle.add_probes(model, compute_loss)
    with engine.scope():
        loss = compute_loss()
    loss.backward()
    cycle.end(model)
    return loss
