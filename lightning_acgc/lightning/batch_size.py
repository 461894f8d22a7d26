"""COMET-style batch-size raising through Lightning's own batch-size tuner.

``ActivationCompression(scale_batch_size="binsearch", memory_budget="2GB")`` runs
Lightning's :class:`~lightning.pytorch.callbacks.BatchSizeFinder` search (the
``power``/``binsearch`` code in ``lightning/pytorch/tuner/batch_size_scaling.py``) on fit
start, after one calibration step and with compression active, so the trials measure
compressed memory:

1. The compression callback installs the engine and runs one calibration step on the
   first batch (begin, exact gradient if the policy wants it, compressed forward and
   backward, end; no optimizer step, RNG and buffers restored).
2. Optionally (``compare_uncompressed=True``) the search runs once with the engine's
   policy swapped for the ``identity`` codec: the same hooks and budget accounting,
   nothing compressed. This is the "without compression" batch size.
3. The search runs with the real policy; the model's ``batch_size`` attribute and the
   dataloaders end at the size found. Then the fit's first step is played ahead at
   that size (a calibration step under the budget, the policy's state restored after
   it): a policy's first calibrated step can keep more than the trials, which run no
   calibration (acgc before its error model has a reading: 1.7x instead of 3.9x on a
   full-width ResNet-18), so the size is halved until that step fits.
4. The learning rate follows ``lr_scaling`` (``"linear"``: × new/old batch, ``"sqrt"``:
   × √(new/old)), for optimizers and the base rates of schedulers, with the factor
   bounded by ``max_lr_factor`` (8 by default; the log line says when it was capped).

Both searches start from ``init_val`` and try sizes up to ``max_val`` and up to the data
set's size divided by ``min_steps_per_epoch`` (8 by default, so an epoch keeps at least
8 steps); when that cap, not memory, stops the search, one log line says so. The
``binsearch`` margin is applied once, and only when a size failed. Under
``memory_budget`` the trials get ``headroom`` (20% by default) less of the room the
budget leaves for activations: an adaptive policy can keep more bytes on a later step
than on the trials (a full-width ResNet-18 under acgc went over the budget by 0.5% on
its first training step at the size a search without headroom had found). The search's
checkpoint goes to a temporary directory, never the working directory. On CPU nothing
runs out of memory, so a search there needs ``memory_budget`` (``ValueError`` at fit
start otherwise).

The tuner empties ``trainer.callbacks`` during its trials; compression stays active
because it is entered around ``Strategy.training_step`` (see ``strategy.py``), not by
a callback hook. On CPU nothing runs out of memory: ``memory_budget`` makes the engine
raise :class:`~lightning_acgc.engine.MemoryBudgetError`, whose message carries the CPU
allocator's out-of-memory text that Lightning's ``is_oom_error`` recognizes. The budget
counts live saved activations plus the bytes of parameters, buffers, gradients and
optimizer state (:func:`static_memory_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.memory import garbage_collection_cuda, is_oom_error
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_acgc.codecs import CodecSpec
from lightning_acgc.engine.compressor import ActivationCompressor
from lightning_acgc.lightning.batch_search import (
    SearchResult,
    TrialRunner,
    dataset_length,
    reset_dataloaders,
    search_sizes,
)

__all__ = [
    "LR_SCALINGS",
    "CompressedBatchSizeFinder",
    "lr_factor",
    "scale_learning_rates",
]

LR_SCALINGS = ("linear", "sqrt")


def lr_factor(old: int, new: int, scaling: str) -> float:
    """Learning-rate multiplier for a batch change ``old -> new``.

    Example:
        >>> lr_factor(32, 128, "linear"), lr_factor(32, 128, "sqrt")
        (4.0, 2.0)
    """
    if scaling not in LR_SCALINGS:
        raise ValueError(f"lr_scaling={scaling!r} is unknown; allowed values: {LR_SCALINGS}")
    ratio = new / old
    return ratio if scaling == "linear" else math.sqrt(ratio)


def scale_learning_rates(trainer: Trainer, factor: float) -> None:
    """Multiply the learning rate of every optimizer group, and the base rates of the
    schedulers, by ``factor``."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * factor
    for config in trainer.lr_scheduler_configs:
        base_lrs = getattr(config.scheduler, "base_lrs", None)
        if base_lrs is not None:
            config.scheduler.base_lrs = [lr * factor for lr in base_lrs]


class CompressedBatchSizeFinder(BatchSizeFinder):
    """Lightning's :class:`~lightning.pytorch.callbacks.BatchSizeFinder`, run by
    :class:`~lightning_acgc.ActivationCompression` with compression active.

    Give it as ``ActivationCompression(scale_batch_size=CompressedBatchSizeFinder(...))``
    for full control (``scale_batch_size="binsearch"`` builds one with the defaults); it
    is not a callback of its own.

    Args:
        mode: ``"power"`` or ``"binsearch"`` (Lightning's search modes).
        steps_per_trial: training steps run per tried batch size.
        init_val: first batch size tried.
        max_trials: most batch-size increases.
        batch_arg_name: the model or datamodule attribute holding the batch size.
        margin: ``binsearch`` keeps this fraction below the largest size that fitted.
        max_val: largest batch size tried.
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``None``: how the learning rate follows a
            changed batch size.
        compare_uncompressed: also search with the ``identity`` codec under the same
            budget and report that size (:attr:`uncompressed_batch_size`).
        max_lr_factor: bound of the learning-rate factor (and of its inverse).
        min_steps_per_epoch: the batch stays at most the data set's size divided by
            this, so an epoch keeps this many steps.
        headroom: under ``memory_budget``, trials must fit in this fraction less of
            the room the budget leaves for activations (after parameters, gradients and
            optimizer state), so that a policy that keeps more bytes on a later step
            (acgc's and comet's recalibrations) still fits the budget in training.

    Raises:
        ValueError: unknown ``mode`` or ``lr_scaling``, ``margin`` or ``headroom``
            outside [0, 1), a non-positive count, or ``max_lr_factor`` < 1.

    Example:
        >>> finder = CompressedBatchSizeFinder("binsearch", steps_per_trial=1, lr_scaling="sqrt")
        >>> finder.lr_scaling, finder.compressed_batch_size
        ('sqrt', None)
    """

    def __init__(
        self,
        mode: str = "binsearch",
        *,
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
        lr_scaling: str | None = None,
        compare_uncompressed: bool = True,
        max_lr_factor: float = 8.0,
        min_steps_per_epoch: int = 8,
        headroom: float = 0.2,
    ) -> None:
        if not isinstance(mode, str) or mode.lower() not in self.SUPPORTED_MODES:
            raise ValueError(f"mode={mode!r} is unknown; allowed values: {self.SUPPORTED_MODES}")
        for name, value in (
            ("steps_per_trial", steps_per_trial),
            ("init_val", init_val),
            ("max_trials", max_trials),
            ("max_val", max_val),
            ("min_steps_per_epoch", min_steps_per_epoch),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if isinstance(max_lr_factor, bool) or not isinstance(max_lr_factor, (int, float)):
            raise ValueError(f"max_lr_factor={max_lr_factor!r} must be a number >= 1")
        if not max_lr_factor >= 1.0:
            raise ValueError(f"max_lr_factor={max_lr_factor!r} must be a number >= 1")
        for name, fraction in (("margin", margin), ("headroom", headroom)):
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
                raise ValueError(f"{name}={fraction!r} must be a number in [0, 1)")
            if not 0.0 <= fraction < 1.0:
                raise ValueError(f"{name}={fraction!r} must be in [0, 1)")
        if lr_scaling is not None and lr_scaling not in LR_SCALINGS:
            raise ValueError(
                f"lr_scaling={lr_scaling!r} is unknown; allowed values: {(*LR_SCALINGS, None)}"
            )
        super().__init__(
            mode=mode,
            steps_per_trial=steps_per_trial,
            init_val=init_val,
            max_trials=max_trials,
            batch_arg_name=batch_arg_name,
            margin=margin,
            max_val=max_val,
        )
        self.lr_scaling = lr_scaling
        self.compare_uncompressed = compare_uncompressed
        self.initial_batch_size: int | None = None
        self.compressed_batch_size: int | None = None
        self.uncompressed_batch_size: int | None = None
        self.max_lr_factor = float(max_lr_factor)
        self.min_steps_per_epoch = min_steps_per_epoch
        self.headroom = float(headroom)
        self.first_step_halvings = 0
        self.lr_factor = 1.0
        self.lr_factor_wanted = 1.0
        self.limit_note: str | None = None
        self._owned = False

    @property
    def batch_arg_name(self) -> str:
        return self._batch_arg_name

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str | None = None) -> None:
        if not self._owned:
            raise MisconfigurationException(
                "CompressedBatchSizeFinder runs inside ActivationCompression: pass it as "
                "ActivationCompression(scale_batch_size=CompressedBatchSizeFinder(...)) "
                "instead of Trainer(callbacks=[...])"
            )
        super().setup(trainer, pl_module, stage)

    # The owning ActivationCompression starts the search; these hooks do nothing.
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        return None

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        return None

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        return None

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        return None

    def _cap(self, trainer: Trainer) -> tuple[int, str]:
        """The largest size to try, and what sets it."""
        n = dataset_length(trainer)
        if n is not None and n // self.min_steps_per_epoch < self._max_val:
            cap = max(1, n // self.min_steps_per_epoch)
            return cap, (
                f"the data set ({n} samples) limits the batch to {cap} "
                f"(min_steps_per_epoch={self.min_steps_per_epoch} steps an epoch), not memory"
            )
        return self._max_val, f"max_val={self._max_val} limits the batch, not memory"

    def _run(self, trainer: Trainer, cap: int) -> SearchResult:
        runner = TrialRunner(trainer, self._batch_arg_name, self._steps_per_trial)
        return runner.run(
            lambda fits: search_sizes(
                fits,
                mode=self._mode,
                init_val=self._init_val,
                max_val=cap,
                max_trials=self._max_trials,
                margin=self._margin,
            )
        )

    def search(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        engine: ActivationCompressor,
        first_step: Callable[[], None] | None = None,
    ) -> int | None:
        """Search (twice with ``compare_uncompressed``) and scale the learning rate;
        returns the batch size found with compression.

        ``first_step`` plays the fit's first step ahead at the size found (the
        callback's replayed calibration step): a policy's first calibrated step can keep
        more than the trials did (acgc's, before its error model has a reading), so
        while it runs out of memory the size is halved.

        Raises:
            ValueError: on CPU without ``memory_budget`` (nothing would stop the search).
        """
        from lightning_acgc.policies.fixed import FixedPolicy

        if engine.memory_budget is None and trainer.strategy.root_device.type == "cpu":
            raise ValueError(
                "scale_batch_size on CPU needs memory_budget (e.g. memory_budget='2GB'): "
                "nothing runs out of memory on CPU, so no trial would ever fail"
            )
        self.initial_batch_size = lightning_getattr(pl_module, self._batch_arg_name)
        cap, why = self._cap(trainer)
        budget = engine.memory_budget
        if budget is not None and budget > engine.budget_base:
            room = budget - engine.budget_base
            engine.memory_budget = engine.budget_base + int(room * (1.0 - self.headroom))
        try:
            if self.compare_uncompressed:
                policy = engine.policy
                engine.policy = FixedPolicy(CodecSpec("identity"))
                try:
                    self.uncompressed_batch_size = self._run(trainer, cap).size
                finally:
                    engine.policy = policy
            result = self._run(trainer, cap)
        finally:
            engine.memory_budget = budget
        found = result.size
        # uncompressed exact passes at a raised batch may not fit a GPU: host memory
        on_gpu = trainer.strategy.root_device.type == "cuda"
        engine.offload_exact = on_gpu and found > (self.initial_batch_size or 0)
        if first_step is not None:
            found = self._first_step_fits(trainer, pl_module, found, first_step)
            engine.offload_exact = on_gpu and found > (self.initial_batch_size or 0)
        self.compressed_batch_size = self.optimal_batch_size = found
        self.limit_note = why if result.limit is not None else None
        initial = self.initial_batch_size
        if self.lr_scaling is not None and initial and found != initial:
            self.lr_factor_wanted = lr_factor(initial, found, self.lr_scaling)
            bound = self.max_lr_factor
            self.lr_factor = min(max(self.lr_factor_wanted, 1.0 / bound), bound)
            scale_learning_rates(trainer, self.lr_factor)
        rank_zero_info(self.report())
        metrics = self.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        return found

    def _first_step_fits(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        size: int,
        first_step: Callable[[], None],
    ) -> int:
        """The largest of ``size``, ``size // 2``, ... at which ``first_step`` runs."""
        while True:
            try:
                first_step()
                return size
            except RuntimeError as err:
                if not is_oom_error(err) or size <= 1:
                    raise
                del err
            garbage_collection_cuda()
            smaller = size // 2
            rank_zero_info(
                f"lightning_acgc: the first training step at batch size {size} ran out of "
                f"memory (its calibration keeps more than the search's trials); {smaller}"
            )
            size = smaller
            self.first_step_halvings += 1
            lightning_setattr(pl_module, self._batch_arg_name, size)
            reset_dataloaders(trainer)

    def metrics(self) -> dict[str, float]:
        """The search's numbers, as logged (``acgc/batch_size`` and friends)."""
        out: dict[str, float] = {}
        if self.compressed_batch_size is not None:
            out["acgc/batch_size"] = float(self.compressed_batch_size)
            out["acgc/lr_factor"] = float(self.lr_factor)
        if self.uncompressed_batch_size is not None:
            out["acgc/batch_size_uncompressed"] = float(self.uncompressed_batch_size)
        return out

    def report(self) -> str:
        """One line: batch size found with and without compression, and the lr factor."""
        text = (
            f"lightning_acgc: batch size {self.initial_batch_size} -> {self.compressed_batch_size}"
        )
        text += " with compression"
        if self.uncompressed_batch_size is not None:
            text += f" ({self.uncompressed_batch_size} without)"
        if self.lr_scaling is not None:
            text += f"; learning rate x{self.lr_factor:.4g} ({self.lr_scaling} scaling"
            if self.lr_factor != self.lr_factor_wanted:
                text += f", capped at max_lr_factor={self.max_lr_factor:g}"
            text += ")"
        if self.limit_note is not None:
            text += f"; {self.limit_note}"
        return text
