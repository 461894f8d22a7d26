"""The batch-size search itself: which sizes to try, and one trial through Lightning's loop.

Lightning's ``_scale_batch_size`` is not used as it is: it stops at the data set's size
without trying it again and returns ``max_val`` untried, it skips its first size when
the model's attribute is already past the data set (so a second search starts where the
first ended and applies the margin again), it can retry the data set's size forever
after a failure there, and it writes its checkpoint into ``default_root_dir``. Here the
sizes come from :func:`search_sizes`, a pure function of a ``fits(size)`` predicate,
and :class:`TrialRunner` runs each trial with Lightning's own loop helpers.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.tuner import batch_size_scaling as _bss
from lightning.pytorch.utilities.memory import garbage_collection_cuda, is_oom_error
from lightning.pytorch.utilities.parsing import lightning_setattr

__all__ = ["SearchResult", "TrialRunner", "dataset_length", "reset_dataloaders", "search_sizes"]

_dump_params = getattr(_bss, "__scale_batch_dump_params")
_reset_params = getattr(_bss, "__scale_batch_reset_params")
_restore_params = getattr(_bss, "__scale_batch_restore_params")


def reset_dataloaders(trainer: Trainer) -> None:
    """Rebuild the trainer's dataloaders at the model's current batch size."""
    _bss._reset_dataloaders(trainer)


class SearchResult:
    """What a search found: ``size`` (the size to train with), ``largest_fit`` (the
    largest size that ran), ``failed`` (the smallest size that did not, or ``None``)
    and ``limit`` (the cap that stopped the search without a failure, or ``None``)."""

    def __init__(self, size: int, largest_fit: int, failed: int | None, limit: int | None):
        self.size, self.largest_fit, self.failed, self.limit = size, largest_fit, failed, limit

    def __repr__(self) -> str:
        return (
            f"SearchResult(size={self.size}, largest_fit={self.largest_fit}, "
            f"failed={self.failed}, limit={self.limit})"
        )


def search_sizes(
    fits: Callable[[int], bool],
    *,
    mode: str,
    init_val: int,
    max_val: int,
    max_trials: int,
    margin: float,
) -> SearchResult:
    """Largest batch size in ``[1, max_val]`` for which ``fits`` holds.

    Sizes double from ``init_val`` (capped at ``max_val``, which is tried too) until a
    size fails; ``binsearch`` then bisects between the last success and the failure
    (``power`` keeps the last success). Below ``init_val``, a failing first size is
    halved down to 1. The margin is applied once, and only when a failure bounded the
    search (a size limited by ``max_val`` was seen to fit). ``max_trials`` bounds the
    number of ``fits`` calls.

    Raises:
        RuntimeError: batch size 1 does not fit.

    Example:
        >>> r = search_sizes(lambda n: n <= 100, mode="binsearch", init_val=2, max_val=1000,
        ...                  max_trials=25, margin=0.05)
        >>> r.largest_fit, r.size
        (100, 95)
        >>> search_sizes(lambda n: True, mode="binsearch", init_val=2, max_val=179,
        ...              max_trials=25, margin=0.05).size
        179
    """
    low, high = 0, None  # largest size that fitted, smallest that did not
    size, trials = min(max(1, init_val), max_val), 0
    while trials < max_trials:
        trials += 1
        if fits(size):
            low = size
            if high is None:
                if size >= max_val:
                    break
                size = min(size * 2, max_val)
                continue
        else:
            high = size
            if low == 0:
                if size == 1:
                    raise RuntimeError("batch size 1 does not fit in memory (or in memory_budget)")
                size = max(1, size // 2)
                continue
        if mode != "binsearch" or high - low <= 1:
            break
        size = (low + high) // 2
    if low == 0:
        raise RuntimeError(f"no batch size fitted in {max_trials} trials (smallest tried: {size})")
    found = low
    if high is not None and mode == "binsearch" and margin > 0:
        found = max(1, int(low * (1 - margin)))
    return SearchResult(found, low, high, max_val if high is None and low >= max_val else None)


def dataset_length(trainer: Trainer) -> int | None:
    """Samples in the training data (``None`` for iterable data sets)."""
    loop = trainer.fit_loop
    loop.setup_data()
    combined = loop._combined_loader
    if combined is None:
        return None
    try:
        return int(combined._dataset_length())
    except (NotImplementedError, TypeError):
        return None


class TrialRunner:
    """Runs training trials at given batch sizes inside a running ``fit``, and puts the
    trainer back as it was (model weights and optimizer from a checkpoint written to a
    temporary directory and deleted, loop state, callbacks, loggers, limits).

    Args:
        trainer: the trainer, in ``on_fit_start``.
        batch_arg_name: the model or datamodule attribute holding the batch size.
        steps_per_trial: training steps per trial.
    """

    def __init__(self, trainer: Trainer, batch_arg_name: str, steps_per_trial: int) -> None:
        self.trainer = trainer
        self.batch_arg_name = batch_arg_name
        self.steps_per_trial = steps_per_trial
        self._params: dict[str, Any] | None = None

    def fits(self, size: int) -> bool:
        """One trial at ``size``; ``False`` on an out-of-memory error (other errors raise)."""
        trainer = self.trainer
        assert self._params is not None, "use TrialRunner as a context manager"
        lightning_setattr(trainer.lightning_module, self.batch_arg_name, size)
        _bss._reset_dataloaders(trainer)
        _bss._reset_progress(trainer)
        garbage_collection_cuda()
        try:
            _bss._try_loop_run(trainer, self._params)
        except RuntimeError as err:
            if not is_oom_error(err):
                raise
            del err
            garbage_collection_cuda()
            return False
        return True

    def run(self, search: Callable[[Callable[[int], bool]], SearchResult]) -> SearchResult:
        """``search(self.fits)`` between a checkpoint and its restore; the model's batch
        size attribute and the dataloaders end at the size found."""
        trainer = self.trainer
        with tempfile.TemporaryDirectory(prefix="acgc_batch_search_") as tmp:
            ckpt = os.path.join(tmp, "initial.ckpt")
            trainer.save_checkpoint(ckpt)
            self._params = _dump_params(trainer)
            _reset_params(trainer, self.steps_per_trial)
            progress = trainer.progress_bar_callback
            if progress:
                progress.disable()
            result: SearchResult | None = None
            try:
                result = search(self.fits)
            finally:
                _restore_params(trainer, self._params)
                if progress:
                    progress.enable()
                trainer._checkpoint_connector.restore(ckpt)
                self._params = None
        lightning_setattr(trainer.lightning_module, self.batch_arg_name, result.size)
        _bss._reset_dataloaders(trainer)
        return result
