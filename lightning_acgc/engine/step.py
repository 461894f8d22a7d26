"""One compressed training step with the policy's calibration cycle, for plain PyTorch.

The Lightning adapter follows the same sequence; this function is what plain-PyTorch
users, tests and benchmarks call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_acgc.engine.compressor import ActivationCompressor

__all__ = ["compressed_step", "exact_gradients", "no_side_effects"]


def _no_reduce(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def no_side_effects(model: nn.Module) -> Iterator[None]:
    """Undo what an extra forward of ``model`` changes: the random states of the CPU and
    of the CUDA devices holding parameters are restored (dropout draws the same masks
    again) and so are the buffers (BatchNorm running statistics)."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    buffers = [(b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"]
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)


def exact_gradients(
    engine: ActivationCompressor, model: nn.Module, compute_loss: Callable[[], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The uncompressed gradient of ``compute_loss()`` by parameter name, leaving no trace:
    ``.grad`` untouched, random state and buffers restored (:func:`no_side_effects`), so
    the compressed pass that follows sees the same dropout masks and statistics."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with no_side_effects(model), engine.paused():
        loss = compute_loss()
        grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return {n: g for (n, _), g in zip(params, grads, strict=True) if g is not None}


def compressed_step(
    engine: ActivationCompressor,
    model: nn.Module,
    compute_loss: Callable[[], torch.Tensor],
    step: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] = _no_reduce,
    loss_halves: tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]] | None = None,
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

    Example:
        >>> from lightning_acgc.policies import build_policy
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        >>> policy = build_policy("acgc", gradient_error=0.05)
        >>> engine = ActivationCompressor(policy, model=model, min_numel=0)
        >>> engine.install(); policy.setup(model)
        >>> x = torch.randn(64, 32)
        >>> loss = compressed_step(engine, model, lambda: model(x).square().mean(), step=0)
        >>> policy.metrics()["grad_error"] < 0.05
        True
        >>> engine.remove()
    """
    policy: Any = engine.policy
    engine.new_step(step)
    policy.begin_step(step)
    if loss_halves is not None and getattr(policy, "needs_noise_estimate", lambda _: False)(step):
        policy.set_noise_gradients(*(exact_gradients(engine, model, f) for f in loss_halves))
    if policy.needs_exact_gradient(step):
        policy.set_exact_gradients(exact_gradients(engine, model, compute_loss))
    with engine.scope():
        loss = compute_loss()
    loss.backward()
    policy.end_step(step, model, reduce)
    return loss
