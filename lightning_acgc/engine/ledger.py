"""Live bytes of saved activations, charged by storage and released with their holders.

Autograd keeps whatever the pack hook returns until the graph is freed (after backward,
or when a step that raised is dropped). The engine returns a holder object for every
tensor it takes; the ledger charges the holder's bytes when it is made and releases them
by a :func:`weakref.finalize` on the holder, so the count follows autograd exactly,
whichever way the step ended. Raw tensors are charged by storage: several views of one
storage held raw cost the storage's bytes once.

Storages are identified by a :class:`~torch.multiprocessing.reductions.StorageWeakRef`
(the storage's own identity, not a view's ``_base``); holding the weak reference keeps
the identity from being reused by a later storage at the same address.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_acgc.engine.meter import CompressionStats

__all__ = ["OOM_MESSAGE", "Ledger", "MemoryBudgetError", "check_budget", "storage_ref"]

# Lightning's ``is_oom_error`` recognizes a RuntimeError with this text (CPU allocator).
OOM_MESSAGE = "DefaultCPUAllocator: can't allocate memory"


class MemoryBudgetError(RuntimeError):
    """Raised when a step's live saved bytes would pass ``memory_budget``. Its message
    contains the CPU allocator's out-of-memory text so that Lightning's batch-size
    tuner treats it as an out-of-memory error."""


def storage_ref(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference naming ``t``'s storage (equal for every view of it)."""
    return StorageWeakRef(t.untyped_storage())


def check_budget(budget: int | None, base: int, live: int, nbytes: int) -> None:
    """Raise :class:`MemoryBudgetError` where holding ``nbytes`` more on top of ``live``
    saved bytes and ``base`` (model and optimizer) would pass ``budget`` (``None``: none).

    Example:
        >>> check_budget(100, 10, 50, 40)
        >>> check_budget(None, 10, 50, 400)
        >>> try:
        ...     check_budget(100, 10, 50, 41)
        ... except MemoryBudgetError as err:
        ...     print(str(err).split("(")[1])
        101 bytes: 50 live saved, 41 new, 10 model and optimizer)
    """
    need = base + live + nbytes
    if budget is not None and need > budget:
        raise MemoryBudgetError(
            f"{OOM_MESSAGE}: lightning_acgc memory_budget of {budget} bytes would be exceeded "
            f"({need} bytes: {live} live saved, {nbytes} new, {base} model and optimizer)"
        )


class _RawEntry:
    __slots__ = ("holders", "nbytes", "ref")

    def __init__(self, ref: StorageWeakRef, nbytes: int) -> None:
        self.ref = ref
        self.nbytes = nbytes
        self.holders = 0


class Ledger:
    """Counts the bytes of the holders alive now into ``stats.live_bytes``, and the
    distinct storages saved in the current step into ``stats.saved_bytes``.

    Args:
        stats: the counters it updates (``live_bytes``, ``peak_live_bytes``,
            ``saved_bytes``).
        check: called with the bytes a holder is about to add, before they are
            charged; raises to refuse them (the memory budget).

    Example:
        >>> stats = CompressionStats()
        >>> ledger = Ledger(stats, check=lambda nbytes: None)
        >>> x = torch.zeros(256)
        >>> class Holder: ...
        >>> a, b = Holder(), Holder()
        >>> ledger.hold_raw(a, x[:128]), ledger.hold_raw(b, x[128:])  # one storage
        (1024, 0)
        >>> stats.live_bytes
        1024
        >>> del a; stats.live_bytes
        1024
        >>> del b; stats.live_bytes
        0
    """

    def __init__(self, stats: CompressionStats, check: Callable[[int], None]) -> None:
        self.stats = stats
        self.check = check
        self._raw: dict[int, _RawEntry] = {}
        self._seen: dict[int, StorageWeakRef] = {}

    def new_step(self) -> None:
        """Forget which storages the previous step saved (its holders stay charged
        until autograd drops them)."""
        self._seen.clear()

    def count_saved(self, t: torch.Tensor, ref: StorageWeakRef | None = None) -> int:
        """Bytes of ``t``'s storage if this step has not saved that storage yet, else 0;
        added to ``stats.saved_bytes``. ``ref``: ``storage_ref(t)`` if the caller has it."""
        ref = ref if ref is not None else storage_ref(t)
        if ref.cdata in self._seen:
            return 0
        self._seen[ref.cdata] = ref
        nbytes = t.untyped_storage().nbytes()
        self.stats.saved_bytes += nbytes
        return nbytes

    def hold_raw(self, holder: object, t: torch.Tensor, ref: StorageWeakRef | None = None) -> int:
        """Charge ``holder``, which keeps ``t`` raw, by storage; returns the bytes added.
        ``ref``: ``storage_ref(t)`` if the caller has it."""
        return self.hold_raw_until(holder, t, ref)[0]

    def hold_raw_until(
        self, holder: object, t: torch.Tensor, ref: StorageWeakRef | None = None
    ) -> tuple[int, weakref.finalize]:
        """:meth:`hold_raw`, also returning the release: calling it drops the charge
        now (once; ``holder`` no longer holds ``t``), else it runs when ``holder`` dies."""
        ref = ref if ref is not None else storage_ref(t)
        entry = self._raw.get(ref.cdata)
        added = 0
        if entry is None or not entry.holders:
            added = t.untyped_storage().nbytes()
            self.check(added)
            entry = self._raw[ref.cdata] = _RawEntry(ref, added)
            self._add(added)
        entry.holders += 1
        return added, weakref.finalize(holder, self._drop_raw, ref.cdata)

    def hold_packed(self, holder: object, nbytes: int) -> None:
        """Charge ``holder``, which keeps ``nbytes`` of packed data (checked first)."""
        self.check(nbytes)
        self._add(nbytes)
        weakref.finalize(holder, self._add, -nbytes)

    def adjust_packed(self, holder: object, delta: int) -> None:
        """Charge ``holder`` ``delta`` more packed bytes (its payload was replaced after
        a deferred check), released with it; not checked against the budget."""
        self._add(delta)
        weakref.finalize(holder, self._add, -delta)

    def _add(self, nbytes: int) -> None:
        self.stats.live_bytes += nbytes
        self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, self.stats.live_bytes)

    def _drop_raw(self, cdata: int) -> None:
        entry = self._raw[cdata]
        entry.holders -= 1
        if not entry.holders:
            del self._raw[cdata]
            self._add(-entry.nbytes)
