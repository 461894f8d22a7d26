"""A payload written before the device has said whether it is valid.

A Triton encode learns only on the device whether its tensor held NaN/inf or a range
that needs float64 (the rare cases that take the slow path). Reading that verdict at
once stalls the host at every saved tensor until the device has caught up, so host and
device take turns between layers instead of working side by side. A codec's
``encode_deferred`` instead writes the payload optimistically and attaches a
:class:`DeferredCheck`: the verdict flags are copied to host memory behind the kernel,
and the check keeps the source tensor until they have arrived; if any flag is set, the
tensor is encoded again on the slow path from that source. ``Packed.settle()`` applies
the verdict (every decode settles first).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from lightning_acgc.codecs.base import Packed

__all__ = ["DeferredCheck"]


class DeferredCheck:
    """The device's verdict on a payload, and the way to redo it if the verdict fails.

    Args:
        flags: int32 tensors of one element each, all 0 where the payload is valid (on
            a CUDA device they are copied to pinned host memory behind the work that
            writes them; elsewhere read when settled).
        source: the tensor that was encoded, kept until the verdict is in.
        redo: encodes ``source`` on the checked path; ``None`` (or an exception) keeps
            ``source`` itself.

    Example:
        >>> import torch
        >>> from lightning_acgc.codecs.identity import raw_packed
        >>> x = torch.ones(3)
        >>> packed = raw_packed(torch.zeros(3))  # stands for a payload the device rejected
        >>> packed.check = DeferredCheck([torch.ones(1, dtype=torch.int32)], x, raw_packed)
        >>> packed.settle()  # the change of the held bytes
        0
        >>> torch.equal(packed.payload["raw"], x), packed.check is None
        (True, True)
    """

    __slots__ = ("_event", "_flags", "_redo", "_source")

    def __init__(
        self,
        flags: Sequence[torch.Tensor],
        source: torch.Tensor,
        redo: Callable[[torch.Tensor], Packed | None],
    ) -> None:
        self._source: torch.Tensor | None = source
        self._redo = redo
        self._event: torch.cuda.Event | None = None
        if flags and flags[0].is_cuda:
            host = torch.empty(len(flags), dtype=torch.int32, pin_memory=True)
            # the copies and the event on the flags' device's current stream, whichever
            # device is current (the event then waits for exactly the work behind them)
            with torch.cuda.device(flags[0].device):
                for i, flag in enumerate(flags):
                    host[i : i + 1].copy_(flag.view(1), non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
            self._flags: Sequence[torch.Tensor] = [host]
        else:
            self._flags = list(flags)

    def ready(self) -> bool:
        """Whether the verdict has arrived (settling would not wait)."""
        return self._event is None or self._event.query()

    def passed(self) -> bool:
        """Wait for the verdict: whether every flag is 0."""
        if self._event is not None:
            self._event.synchronize()
        return not any(v for flag in self._flags for v in flag.tolist())

    def rebase(self, source: torch.Tensor, redo: Callable[[torch.Tensor], Packed | None]) -> None:
        """Encode ``source`` with ``redo`` if the verdict fails, instead of the tensor
        the inner codec was given: a codec that wraps another (and transformed its input)
        keeps its own input and its own checked encode, and the transformed copy can go."""
        self._source, self._redo = source, redo

    def replacement(self) -> Packed | None:
        """Settle: ``None`` where the payload is valid, else the source encoded again on
        the checked path (or kept as it is if that declines or fails). Drops the source."""
        source, self._source = self._source, None
        assert source is not None, "a DeferredCheck settles once"
        if self.passed():
            return None
        try:
            packed = self._redo(source)
        except Exception as err:  # nothing is lost: keep the tensor
            warnings.warn(
                f"lightning_acgc: encoding again after the device's check failed ({err}); "
                "kept uncompressed",
                stacklevel=3,
            )
            packed = None
        if packed is None:  # the identity codec's form: the tensor itself
            packed = Packed("identity", source.shape, source.dtype, {"raw": source})
        return packed
