"""Running ``training_step`` outside Lightning's loop without side effects, and the
``reduce`` over ranks. Nothing here is public API."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_acgc.engine.cycle import no_side_effects

__all__ = [
    "call_training_step",
    "first_train_batch",
    "make_reduce",
    "no_logging",
    "offline",
    "step_loss",
    "training_loss",
]

_MISSING = object()


# -- running training_step outside the loop ---------------------------------------
@contextlib.contextmanager
def no_logging(pl_module: LightningModule) -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing meanwhile (an extra ``training_step``),
    and ``pl_module.acgc_calibrating`` is True, so the step can tell
    (``getattr(self, "acgc_calibrating", False)``)."""
    names = ("log", "log_dict", "acgc_calibrating")
    previous = {name: pl_module.__dict__.get(name, _MISSING) for name in names}

    def _no_log(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.__dict__["log"] = _no_log
    pl_module.__dict__["log_dict"] = _no_log
    pl_module.__dict__["acgc_calibrating"] = True
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
    objects updated, counters) do happen twice; ``pl_module.acgc_calibrating`` is True
    meanwhile."""
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
