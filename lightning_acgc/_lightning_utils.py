"""Plumbing shared by the Lightning adapter: the per-step scope, the strategy patch for
callback-only use, and running ``training_step`` outside the loop without side effects.

Nothing here is public API. The callback (``callback.py``) owns one :class:`StepScope`
per fit; the compression strategies (``strategy.py``) and, for stock strategies, a
:class:`TrainingStepPatch` call :meth:`StepScope.run` around ``training_step``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_acgc.engine.compressor import ActivationCompressor
from lightning_acgc.engine.step import no_side_effects

__all__ = [
    "CompressionScopeMixin",
    "StepScope",
    "TrainingStepPatch",
    "call_training_step",
    "exact_gradients",
    "first_train_batch",
    "make_reduce",
    "mean_over_ranks",
    "offline",
    "training_loss",
]

_MISSING = object()


class StepScope:
    """Runs one ``training_step`` call as one engine step inside the saved-tensor hooks.

    Args:
        engine: the installed engine of the running fit.
        step: the first step number; seeds derive from it, so a resumed run passes the
            number it had reached (see :meth:`ActivationCompression.state_dict`).
    """

    def __init__(self, engine: ActivationCompressor, step: int = 0) -> None:
        self.engine = engine
        self.step = step

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as a new engine step with compression active."""
        self.engine.new_step(self.step)
        self.step += 1
        with self.engine.scope():
            return fn(*args, **kwargs)


class CompressionScopeMixin:
    """Strategy mixin: ``training_step`` runs inside the attached :class:`StepScope`.

    With no scope attached (no :class:`~lightning_acgc.ActivationCompression` active),
    the strategy behaves exactly like its Lightning parent.
    """

    _acgc_scope: StepScope | None = None

    def attach_compression(self, scope: StepScope) -> None:
        """Scope every later ``training_step`` with ``scope`` (called on fit start)."""
        if self._acgc_scope is not None and self._acgc_scope is not scope:
            raise RuntimeError(
                f"{type(self).__name__} already runs another ActivationCompression; "
                "one compression callback per Trainer"
            )
        self._acgc_scope = scope

    def detach_compression(self) -> None:
        """Stop scoping ``training_step`` (called on fit end and on exceptions)."""
        self._acgc_scope = None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        scope = self._acgc_scope
        if scope is None:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        return scope.run(super().training_step, *args, **kwargs)  # type: ignore[misc]


class TrainingStepPatch:
    """Wraps ``strategy.training_step`` on this one instance (a stock Lightning strategy)
    and undoes exactly that in :meth:`restore`; the class and other instances are untouched.

    Args:
        strategy: the trainer's strategy instance.
        scope: what each call runs inside.
    """

    def __init__(self, strategy: Strategy, scope: StepScope) -> None:
        self.strategy = strategy
        self._previous = strategy.__dict__.get("training_step", _MISSING)
        original = strategy.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            return scope.run(original, *args, **kwargs)

        training_step.__wrapped__ = original  # type: ignore[attr-defined]
        self._wrapper = training_step
        strategy.training_step = training_step  # type: ignore[method-assign]

    def restore(self) -> None:
        """Put back what was there before (idempotent)."""
        if self._wrapper is None:
            return
        current = self.strategy.__dict__.get("training_step", _MISSING)
        if current is not self._wrapper:
            rank_zero_warn(
                "lightning_acgc: strategy.training_step was replaced by someone else while "
                "ActivationCompression wrapped it; leaving the current one in place"
            )
        elif self._previous is _MISSING:
            del self.strategy.__dict__["training_step"]
        else:
            self.strategy.__dict__["training_step"] = self._previous
        self._wrapper = None


# -- running training_step outside the loop ---------------------------------------
@contextlib.contextmanager
def offline(pl_module: LightningModule) -> Iterator[None]:
    """Undo the side effects of an extra ``training_step`` call: the RNG states are
    restored (dropout draws the same masks again), buffers (BatchNorm running
    statistics) are restored, and ``self.log``/``self.log_dict`` do nothing meanwhile.

    Other side effects of the user's ``training_step`` (metric objects updated, counters)
    do happen twice; meanwhile ``pl_module.acgc_calibrating`` is True, so the step can
    tell (``getattr(self, "acgc_calibrating", False)``).
    """
    names = ("log", "log_dict", "acgc_calibrating")
    previous = {name: pl_module.__dict__.get(name, _MISSING) for name in names}

    def _no_log(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.__dict__["log"] = _no_log
    pl_module.__dict__["log_dict"] = _no_log
    pl_module.__dict__["acgc_calibrating"] = True
    try:
        with no_side_effects(pl_module):
            yield
    finally:
        for name, value in previous.items():
            if value is _MISSING:
                pl_module.__dict__.pop(name, None)
            else:
                pl_module.__dict__[name] = value


def call_training_step(
    trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
) -> Any:
    """``pl_module.training_step`` as the loop calls it (signature, precision context),
    but on the module itself rather than through a DDP wrapper."""
    args: list[Any] = [batch]
    if is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2):
        args.append(batch_idx)
    with trainer.precision_plugin.train_step_context():
        return pl_module.training_step(*args)


def training_loss(output: Any) -> torch.Tensor | None:
    """The loss in a ``training_step`` output (a tensor, or a mapping with ``"loss"``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


def exact_gradients(
    trainer: Trainer,
    pl_module: LightningModule,
    engine: ActivationCompressor,
    batch: Any,
    batch_idx: int,
    scale: float = 1.0,
) -> dict[str, torch.Tensor] | None:
    """Uncompressed gradient of ``scale * loss`` by parameter name, ``.grad`` untouched.

    Runs ``training_step`` once more with the engine paused and without side effects
    (:func:`offline`); ``None`` when the step returns no differentiable loss.
    """
    named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
    if not named:
        return None
    with offline(pl_module), engine.paused():
        loss = training_loss(call_training_step(trainer, pl_module, batch, batch_idx))
        if loss is None or not loss.requires_grad:
            return None
        grads = torch.autograd.grad(
            loss * scale if scale != 1.0 else loss, [p for _, p in named], allow_unused=True
        )
    return {
        n: (g.detach() if g is not None else torch.zeros_like(p))
        for (n, p), g in zip(named, grads, strict=True)
    }


def make_reduce(trainer: Trainer) -> Callable[[torch.Tensor], torch.Tensor]:
    """Average of a tensor over ranks (identity on one process); inputs stay unchanged."""
    strategy = trainer.strategy
    if trainer.world_size <= 1:
        return lambda t: t
    return lambda t: strategy.reduce(t.detach().clone(), reduce_op="mean")


def mean_over_ranks(
    grads: dict[str, torch.Tensor], reduce: Callable[[torch.Tensor], torch.Tensor], world_size: int
) -> dict[str, torch.Tensor]:
    """``grads`` averaged over ranks in one collective (flattened and split again)."""
    if world_size <= 1 or not grads:
        return grads
    names = list(grads)
    flat = torch.cat([grads[n].reshape(-1).float() for n in names])
    flat = reduce(flat)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for n in names:
        g = grads[n]
        out[n] = flat[offset : offset + g.numel()].view_as(g).to(g.dtype)
        offset += g.numel()
    return out


def first_train_batch(trainer: Trainer, pl_module: LightningModule) -> Any:
    """The first training batch, on the device, as the loop would prepare it.

    The global RNG is restored afterwards (a shuffling sampler draws its seed from it).
    """
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    trainer.fit_loop.setup_data()
    loaders = trainer.train_dataloader
    if loaders is None:
        raise ValueError("ActivationCompression: the training dataloader is empty")
    device = pl_module.device
    devices = [device.index or 0] if device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        iterator = iter(CombinedLoader(loaders, "max_size_cycle"))
        batch, _, _ = next(iterator)
        del iterator
    batch = trainer.precision_plugin.convert_input(batch)
    batch = pl_module.on_before_batch_transfer(batch, 0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)
