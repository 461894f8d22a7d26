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
from lightning_acgc.engine.cycle import no_side_effects

__all__ = [
    "CompressionScopeMixin",
    "StepScope",
    "TrainingStepPatch",
    "call_training_step",
    "first_train_batch",
    "make_reduce",
    "no_logging",
    "offline",
    "step_loss",
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
def no_logging(pl_module: LightningModule) -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing meanwhile (an extra ``training_step``)."""
    previous = {name: pl_module.__dict__.get(name, _MISSING) for name in ("log", "log_dict")}

    def _no_log(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.__dict__["log"] = _no_log
    pl_module.__dict__["log_dict"] = _no_log
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is _MISSING:
                pl_module.__dict__.pop(name, None)
            else:
                pl_module.__dict__[name] = value


@contextlib.contextmanager
def offline(pl_module: LightningModule) -> Iterator[None]:
    """Undo the side effects of an extra ``training_step`` call: the RNG states and
    buffers are restored (:func:`~lightning_acgc.engine.no_side_effects`) and logging is
    off (:func:`no_logging`). Other side effects of the user's ``training_step`` (metric
    objects updated, counters) do happen twice."""
    with no_logging(pl_module), no_side_effects(pl_module):
        yield


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


def step_loss(
    trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
) -> Callable[[], torch.Tensor | None]:
    """The loss of ``training_step`` on ``batch`` as a function, logging off, for
    :meth:`~lightning_acgc.engine.CalibrationCycle.add_exact_gradient`."""

    def compute_loss() -> torch.Tensor | None:
        with no_logging(pl_module):
            return training_loss(call_training_step(trainer, pl_module, batch, batch_idx))

    return compute_loss


def make_reduce(trainer: Trainer) -> Callable[[torch.Tensor], torch.Tensor]:
    """Average of a tensor over ranks (identity on one process); inputs stay unchanged."""
    strategy = trainer.strategy
    if trainer.world_size <= 1:
        return lambda t: t
    return lambda t: strategy.reduce(t.detach().clone(), reduce_op="mean")


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
