"""What a saved tensor becomes: the :class:`Packed` container and the codec protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from lightning_acgc.codecs.deferred import DeferredCheck

__all__ = ["Codec", "Packed", "span_nbytes", "storage_nbytes"]


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (what keeping ``t`` alive costs)."""
    if t.is_sparse:
        return sum(storage_nbytes(x) for x in (t._indices(), t._values()))
    return t.untyped_storage().nbytes()


def span_nbytes(t: torch.Tensor) -> int:
    """Bytes of memory the strided view ``t`` spans (its own data, not the whole storage;
    an expanded dimension of stride 0 counts once)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True)
    )
    return span * t.element_size()


@dataclass
class Packed:
    """A saved tensor in compressed form.

    Args:
        codec: name of the codec that wrote it (the registry key that decodes it).
        shape: shape of the original tensor.
        dtype: dtype of the original tensor.
        payload: every tensor the codec keeps; their storages are the bytes kept.
        meta: small Python values (seed, bits, bound) needed to decode.
        check: the device's verdict on a payload written before it was known (see
            :mod:`lightning_acgc.codecs.deferred`); ``None`` once settled or if none.
    """

    codec: str
    shape: torch.Size
    dtype: torch.dtype
    payload: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    check: DeferredCheck | None = field(default=None, repr=False, compare=False)

    def settle(self) -> int:
        """Apply a deferred check: wait for the verdict and, where it failed, take the
        form encoded again on the checked path (another codec name, payload, meta).
        Returns the change of :attr:`nbytes` (0 unless the payload was replaced)."""
        check, self.check = self.check, None
        again = None if check is None else check.replacement()
        if again is None:
            return 0
        before = self.nbytes
        self.codec, self.payload, self.meta = again.codec, again.payload, again.meta
        return self.nbytes - before

    @property
    def nbytes(self) -> int:
        """Bytes held by the payload tensors (distinct storages counted once)."""
        seen: dict[int, int] = {}
        for t in self.payload.values():
            if t.is_sparse:
                seen[id(t)] = storage_nbytes(t)
            else:  # one storage object a tensor (this runs for every saved tensor)
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    @property
    def device(self) -> torch.device:
        """Device of the payload (and of the decoded tensor)."""
        return next(iter(self.payload.values())).device


@runtime_checkable
class Codec(Protocol):
    """Turns a tensor into a :class:`Packed` and back.

    ``encode`` returns ``None`` for a tensor the codec cannot take; the engine then
    keeps that tensor as it is. A codec may also offer ``encode_deferred(x, seed)``, the
    same without waiting for a device's verdict on its payload (a ``Packed`` with a
    ``check``, see :mod:`lightning_acgc.codecs.deferred`); the engine prefers it.
    """

    name: ClassVar[str]

    def encode(self, x: torch.Tensor, seed: int) -> Packed | None: ...

    def decode(self, packed: Packed) -> torch.Tensor: ...
