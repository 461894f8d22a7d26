"""The saved tensors whose device check is still out (see
:mod:`lightning_acgc.codecs.deferred`), settled as soon as their verdict is in.

A deferred check keeps its source tensor alive, so the engine lets at most ``limit`` of
them wait: when one more comes, the oldest is settled, waiting for the device if need
be. With a limit of one the host runs one saved tensor ahead of the device's verdict,
enough for the device to keep working while the host prepares the next layer (each
encode waited for the device before, so host and device took turns), and at most one
source tensor outlives its use.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable

from lightning_acgc.engine.saved import Saved

__all__ = ["PendingChecks"]


class PendingChecks:
    """Holders (:class:`~lightning_acgc.engine.saved.Saved`) of packed tensors with a
    deferred check, oldest first, held weakly (a graph freed early takes its holders).

    Args:
        on_settled: called with the holder and the change of its packed bytes after a
            settle that replaced the payload (the engine's byte counts follow).
        limit: checks allowed to wait at once.

    Example:
        >>> import torch
        >>> from lightning_acgc.codecs import build_codec
        >>> from lightning_acgc.codecs.deferred import DeferredCheck
        >>> codec, x = build_codec("quant", {}), torch.randn(512)
        >>> packed = codec.encode(x, 0)
        >>> packed.check = DeferredCheck([torch.zeros(1, dtype=torch.int32)], x, codec.encode)
        >>> pending = PendingChecks(lambda saved, delta: None)
        >>> saved = Saved(packed, codec, "site", "quant")  # what autograd holds
        >>> pending.add(saved); len(pending)
        1
        >>> pending.poll(); len(pending), packed.check  # a CPU verdict is in at once
        (0, None)
    """

    def __init__(self, on_settled: Callable[[Saved, int], None], limit: int = 1) -> None:
        self._waiting: collections.deque[weakref.ReferenceType[Saved]] = collections.deque()
        self._on_settled = on_settled
        self.limit = limit

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, saved: Saved) -> None:
        """Keep ``saved`` if its packed tensor waits for a check; then settle the oldest
        while more than ``limit`` wait."""
        if saved.packed is not None and saved.packed.check is not None:
            self._waiting.append(weakref.ref(saved))
        while len(self._waiting) > self.limit:
            self._settle(self._waiting.popleft())

    def poll(self) -> None:
        """Settle the oldest checks whose verdict has arrived (never waits)."""
        while self._waiting:
            saved = self._waiting[0]()
            check = None if saved is None or saved.packed is None else saved.packed.check
            if check is not None and not check.ready():
                return
            self._settle(self._waiting.popleft())

    def settle_all(self) -> None:
        """Settle every waiting check (waits for the device)."""
        while self._waiting:
            self._settle(self._waiting.popleft())

    def _settle(self, ref: weakref.ReferenceType[Saved]) -> None:
        saved = ref()
        if saved is None or saved.packed is None or saved.packed.check is None:
            return  # freed, or settled by its decode
        delta = saved.packed.settle()
        if delta:
            self._on_settled(saved, delta)
