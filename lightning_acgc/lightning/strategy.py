"""Compression strategies: Lightning's single-device, DDP and FSDP strategies whose
``training_step`` runs inside the engine's saved-tensor hooks.

Why a strategy and not only callback hooks: ``Strategy.training_step`` is the one call
that wraps exactly the training forward — every forward of a manual-optimization step,
nothing of validation — and it is still called while Lightning's batch-size tuner runs
its trials, when ``trainer.callbacks`` is emptied (``tuner/batch_size_scaling.py``
sets ``trainer.callbacks = []`` for the trials). Entering the hooks there, with a
``with`` block, also exits them on every exception.

The configuration stays in :class:`~lightning_acgc.ActivationCompression`; the strategy
only provides the scope. ``Trainer(strategy="acgc")`` alone adds a default
``ActivationCompression()`` callback (or the one given as ``compression=``). With a
stock Lightning strategy, the callback wraps that strategy instance's
``training_step`` in the same way and puts it back on fit end (see ``lightning/callback.py``).

Registered names (``Trainer(strategy=...)``): ``"acgc"`` (one device, taken from
``accelerator``/``devices``), ``"acgc_ddp"``, ``"acgc_ddp_spawn"``, ``"acgc_ddp_fork"``,
``"acgc_fsdp"``.

FSDP: :class:`ACGCFSDPStrategy` scopes the hooks the same way; parameters gathered by
FSDP are leaves and pass through untouched. Lightning allows FSDP on CUDA only, so it
is not exercised by the CPU test suite.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_acgc.lightning.callback import ActivationCompression
from lightning_acgc.lightning.scope import CompressionScopeMixin

__all__ = ["ACGCDDPStrategy", "ACGCFSDPStrategy", "ACGCStrategy", "register_acgc_strategies"]


def _connect_compression(model: LightningModule, compression: ActivationCompression | None) -> None:
    """Make sure a trainer fitting ``model`` has an ActivationCompression."""
    try:
        trainer = model.trainer
    except RuntimeError:  # not attached to a Trainer
        return
    if trainer.state.fn != TrainerFn.FITTING:
        return
    present = [cb for cb in trainer.callbacks if isinstance(cb, ActivationCompression)]
    if compression is not None and present and compression not in present:
        raise ValueError(
            "ActivationCompression was given both to the strategy (compression=...) and to "
            "Trainer(callbacks=...); give it in one place"
        )
    if not present:
        callback = compression if compression is not None else ActivationCompression()
        if compression is None:
            rank_zero_info(
                "lightning_acgc: no ActivationCompression callback given; using the defaults "
                f"({callback.describe()})"
            )
        trainer.callbacks.append(callback)


class _CompressionStrategy(CompressionScopeMixin):
    """What every compression strategy adds to its Lightning parent: a ``compression``
    argument, and on ``connect`` an ActivationCompression among the trainer's callbacks."""

    def __init__(
        self, *args: Any, compression: ActivationCompression | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._compression = compression

    @override
    def connect(self, model: LightningModule) -> None:
        super().connect(model)  # type: ignore[misc]
        _connect_compression(model, self._compression)


class ACGCStrategy(_CompressionStrategy, SingleDeviceStrategy):
    """Single-device strategy that compresses the activations of ``training_step``.

    Args:
        device: the device; ``None`` takes it from the Trainer's ``accelerator`` and
            ``devices`` (one device).
        compression: the :class:`~lightning_acgc.ActivationCompression` to use when the
            Trainer has none among its callbacks (default: ``ActivationCompression()``).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.

    Raises:
        ValueError: more than one device, or a ``compression`` given both here and to
            ``Trainer(callbacks=...)``.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(strategy="acgc", accelerator="cpu", logger=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.root_device
        ('ACGCStrategy', device(type='cpu'))
    """

    strategy_name = "acgc"

    def __init__(
        self,
        device: _DEVICE | None = None,
        *,
        compression: ActivationCompression | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            device="cpu" if device is None else device, compression=compression, **kwargs
        )
        self._device_given = device is not None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The device as a one-element list (read by Lightning's accelerator connector)."""
        return [self._root_device] if self._device_given else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if not devices:
            return
        if len(devices) > 1:
            raise ValueError(
                f"strategy 'acgc' runs on one device, got devices={devices}; "
                "use strategy='acgc_ddp' for several"
            )
        self._root_device = devices[0]
        self._device_given = True


class ACGCDDPStrategy(_CompressionStrategy, DDPStrategy):
    """DDP strategy that compresses the activations of ``training_step`` on every rank.

    Codec settings are identical on every rank: policies calibrate from statistics
    averaged over ranks (the ``reduce`` passed to ``Policy.end_step``).

    Args:
        compression: the :class:`~lightning_acgc.ActivationCompression` to use when the
            Trainer has none among its callbacks.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`
            (``start_method``, ``find_unused_parameters``, ...).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(strategy="acgc_ddp_spawn", accelerator="cpu", devices=2, logger=False)
        >>> type(trainer.strategy).__name__, trainer.num_devices
        ('ACGCDDPStrategy', 2)
    """

    strategy_name = "acgc_ddp"


class ACGCFSDPStrategy(_CompressionStrategy, FSDPStrategy):
    """FSDP strategy that compresses the activations of ``training_step`` on every rank.

    Needs CUDA like Lightning's FSDP. The exact-gradient pass of calibrating policies is
    skipped under FSDP (parameters are sharded outside FSDP's forward).

    Args:
        compression: the :class:`~lightning_acgc.ActivationCompression` to use when the
            Trainer has none among its callbacks.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.FSDPStrategy`.

    Example:
        >>> ACGCFSDPStrategy(sharding_strategy="SHARD_GRAD_OP").strategy_name
        'acgc_fsdp'
    """

    strategy_name = "acgc_fsdp"


def register_acgc_strategies() -> None:
    """Register the compression strategies in Lightning's ``StrategyRegistry`` (idempotent)."""
    entries: list[tuple[str, type, str, dict[str, Any]]] = [
        ("acgc", ACGCStrategy, "single device, compressed activations", {}),
        ("acgc_ddp", ACGCDDPStrategy, "DDP (popen), compressed activations", {}),
        (
            "acgc_ddp_spawn",
            ACGCDDPStrategy,
            "DDP (spawn), compressed activations",
            {"start_method": "spawn"},
        ),
        (
            "acgc_ddp_fork",
            ACGCDDPStrategy,
            "DDP (fork), compressed activations",
            {"start_method": "fork"},
        ),
        ("acgc_fsdp", ACGCFSDPStrategy, "FSDP, compressed activations", {}),
    ]
    for name, cls, description, params in entries:
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description, **params)


register_acgc_strategies()
