"""``intpack``: integer tensors packed losslessly into the bits their values need."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from lightning_acgc.codecs._checks import check_group_size
from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.identity import raw_packed
from lightning_acgc.codecs.registry import register_codec
from lightning_acgc.kernels.intpack import (
    INT_DTYPES,
    intpack_decode,
    intpack_encode,
    window_encode,
)

__all__ = ["IntPackCodec", "IntPackConfig"]

FINGERPRINT_SAMPLE = 256  # values summed into a packed span's fingerprint


@dataclass(frozen=True)
class IntPackConfig:
    """Options of the ``intpack`` codec.

    Args:
        group_size: values sharing one int64 base (positive multiple of 8).
    """

    group_size: int = 256

    def __post_init__(self) -> None:
        check_group_size("group_size", self.group_size)


class _Source:
    """The packed storage behind one or more saved views, decoded once per backward: the
    decoded storage is kept until each view that refers to it has been decoded."""

    def __init__(
        self,
        payload: dict[str, torch.Tensor],
        start: int,
        numel: int,
        dtype: torch.dtype,
        backend: str,
    ) -> None:
        self.payload, self.start, self.numel, self.dtype = payload, start, numel, dtype
        self.backend = backend
        self.users = 0
        self._left = 0
        self._decoded: torch.Tensor | None = None

    def view(self, offset: int, shape: torch.Size, stride: tuple[int, ...], gs: int):
        if self._decoded is None:
            args = (self.payload, gs, self.numel, self.dtype)
            self._decoded = intpack_decode(*args, backend=self.backend)
            self._left = self.users
        out = self._decoded.as_strided(shape, stride, offset - self.start)
        self._left -= 1
        if self._left <= 0:  # every view read: the next backward decodes again
            self._decoded = None
        return out


def _anchor(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _last(t: torch.Tensor) -> int:
    """Storage index of ``t``'s last element (non-empty, non-negative strides)."""
    return t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))


def _span(t: torch.Tensor) -> torch.Tensor:
    """The flat elements of ``t``'s storage from its first to its last element (a view)."""
    if t.is_contiguous():
        return t.view(-1)
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
    return flat[t.storage_offset() : _last(t) + 1]


@register_codec("intpack", IntPackConfig)
class IntPackCodec:
    """Frame-of-reference + bit packing of integer tensors (pooling indices, token
    indices, offsets, ``edge_index``); decoding returns the exact tensor, dtype and shape.
    Max-pool indices (contiguous, >= 3 dimensions) are packed against the window each
    output reads when that is narrower (2-4 bits a value instead of 10-14:
    :mod:`lightning_acgc.kernels.intpack.window`).
    Floating and bool tensors are declined (``encode`` returns ``None``), and so is a
    tensor that packing would not shrink.

    Views are packed through their storage: an expanded index (stride 0, as
    ``scatter``'s ``index.expand_as(src)``) costs its distinct values only, and views of
    one storage saved while it is alive (the two rows of an ``edge_index``) share one
    packed copy, counted once (the later views' payloads are empty) and decoded once per
    backward.

    Example:
        >>> import torch
        >>> codec = IntPackCodec(IntPackConfig())
        >>> idx = torch.randint(0, 1000, (4, 4096))
        >>> packed = codec.encode(idx, seed=0)
        >>> torch.equal(codec.decode(packed), idx), round(idx.numel() * 8 / packed.nbytes, 1)
        (True, 6.2)
    """

    backend = "auto"

    def __init__(self, config: IntPackConfig) -> None:
        self.config = config
        # (storage address, dtype, device) -> (anchor tensor, its version, packed source,
        # offset of this storage's element 0 in the source's storage), while alive
        self._sources: dict[tuple, tuple[weakref.ref, int, weakref.ref, int]] = {}
        # (dtype, device, numel, sampled sum) of a packed span -> its source
        self._contents: dict[tuple, weakref.ref] = {}

    def _same_content(self, span: torch.Tensor) -> tuple[_Source | None, tuple]:
        """A live source whose values equal ``span`` (an equal tensor recomputed by another
        layer, e.g. GCN's normalized ``edge_index``), checked exactly. The fingerprint
        sums an evenly strided sample of about ``FINGERPRINT_SAMPLE`` values, ending at
        the last (a full sum was a tenth of encoding 4 MB; 4096 values and
        the ends apart, a twentieth): a collision costs one decode and a compare."""
        n = span.numel()
        step = max(1, (n - 1) // FINGERPRINT_SAMPLE)
        sample = span[(n - 1) % step :: step]  # ends at the last value
        fp = (span.dtype, span.device, n, int(sample.sum()))
        ref = self._contents.get(fp)
        source = ref() if ref is not None else None
        if source is None or source.numel != n:
            return None, fp
        gs = self.config.group_size
        args = (source.payload, gs, source.numel, span.dtype)
        decoded = intpack_decode(*args, backend=self.backend)
        same = torch.equal(decoded, span)
        return (source if same else None), fp

    def _view_of(self, x: torch.Tensor, source: _Source, delta: int, meta: dict) -> Packed:
        source.users += 1
        meta["view"] = (x.storage_offset() + delta, x.stride())
        none = {"shared": torch.empty(0, dtype=torch.uint8, device=x.device)}  # 0 bytes
        return Packed(self.name, x.shape, x.dtype, none, {**meta, "source": source})

    def _shared(self, x: torch.Tensor) -> Packed | None:
        """A packed view of ``x``'s storage, reusing the packed copy of a live sibling."""
        anchor = _anchor(x)
        key = (x.untyped_storage().data_ptr(), x.dtype, x.device)
        hit = self._sources.get(key)
        source, delta = None, 0
        if hit is not None and hit[0]() is anchor and hit[1] == anchor._version:
            source, delta = hit[2](), hit[3]
        meta = {"group_size": self.config.group_size, "view": (x.storage_offset(), x.stride())}
        first, last = x.storage_offset() + delta, _last(x) + delta
        if source is not None and source.start <= first and last < source.start + source.numel:
            return self._view_of(x, source, delta, meta)
        self._sources = {k: v for k, v in self._sources.items() if v[0]() is not None}
        self._contents = {k: v for k, v in self._contents.items() if v() is not None}
        span = _span(x)
        source, fp = self._same_content(span)
        if source is not None:  # equal values: this storage maps onto the source's
            delta = source.start - x.storage_offset()
            self._sources[key] = (weakref.ref(anchor), anchor._version, weakref.ref(source), delta)
            return self._view_of(x, source, delta, meta)
        payload = window_encode(x, backend=self.backend) if span.numel() == x.numel() else None
        if payload is None:
            payload = intpack_encode(span, self.config.group_size, backend=self.backend)
        if sum(t.numel() * t.element_size() for t in payload.values()) >= span.numel() * (
            span.element_size()
        ):
            return None  # would not shrink
        source = _Source(payload, x.storage_offset(), span.numel(), x.dtype, self.backend)
        source.users = 1
        self._sources[key] = (weakref.ref(anchor), anchor._version, weakref.ref(source), 0)
        self._contents[fp] = weakref.ref(source)
        return Packed(self.name, x.shape, x.dtype, payload, {**meta, "source": source})

    def encode(self, x: torch.Tensor, seed: int) -> Packed | None:
        if x.dtype not in INT_DTYPES:
            return None
        if x.numel() == 0:
            return raw_packed(x)
        if _last(x) + 1 - x.storage_offset() <= 2 * x.numel():  # its span is mostly x
            return self._shared(x)
        payload = intpack_encode(x, self.config.group_size, backend=self.backend)
        packed = Packed(
            self.name, x.shape, x.dtype, payload, {"group_size": self.config.group_size}
        )
        if packed.nbytes >= x.numel() * x.element_size():
            return None
        return packed

    def decode(self, packed: Packed) -> torch.Tensor:
        if packed.codec == "identity":
            return packed.payload["raw"]
        if "source" in packed.meta:
            offset, stride = packed.meta["view"]
            return packed.meta["source"].view(
                offset, packed.shape, stride, packed.meta["group_size"]
            )
        n = packed.shape.numel()
        gs = packed.meta["group_size"]
        flat = intpack_decode(packed.payload, gs, n, packed.dtype, backend=self.backend)
        return flat.view(packed.shape)
