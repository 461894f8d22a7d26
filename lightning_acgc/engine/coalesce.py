"""Small saved tensors encoded together: one codec call per chunk instead of one per tensor.

An RNN saves a few tensors of a few hundred elements per time step. Encoding each alone
costs a fixed ~0.1-0.5 ms of codec calls (several torch ops on tiny tensors), more than
the step itself. The engine instead appends them, as they are saved, to an open
:class:`Chunk` of their codec (one per codec, dtype and device); a chunk is encoded when
it holds :data:`CHUNK_NUMEL` elements, when the saving scope ends, or when backward
first unpacks a tensor (whichever comes first). Until then its tensors are held raw.

Each tensor starts at a multiple of the codec's ``group_size`` and its last group is
padded with its own last value, so every group holds values of one tensor only: the
values are encoded exactly as if the tensor were encoded alone (same groups, same
ranges), only the random bits differ. Backward decodes a chunk once and hands each
tensor its slice; the decoded chunk is kept until each of its tensors was unpacked
(again for a second backward under ``retain_graph``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from lightning_acgc.codecs.base import Codec, Packed
from lightning_acgc.engine.meter import CompressionStats

__all__ = ["CHUNK_NUMEL", "Chunk", "Coalescer", "Member", "alignment"]

# Elements per chunk before it is encoded (256 KB of fp32): large enough that one codec
# call per chunk costs little next to the step, small enough to bound the raw bytes held
# before encoding.
CHUNK_NUMEL = 1 << 16


def alignment(codec: Codec) -> int:
    """Elements each tensor of a chunk is aligned to: the codec's ``group_size`` (every
    group then holds one tensor's values), or 1 for a codec without groups.

    Example:
        >>> from lightning_acgc.codecs.quant import QuantCodec, QuantConfig
        >>> alignment(QuantCodec(QuantConfig(group_size=128)))
        128
    """
    size = getattr(getattr(codec, "config", None), "group_size", 1)
    return size if isinstance(size, int) and size > 0 else 1


class Member:
    """One tensor of a chunk: where its values are and what to charge or record for it.

    Args:
        holder: weak reference to the engine's holder (autograd may drop it first).
        site: key of the site that saved it.
        part: the tensor's compact part, held raw until the chunk is encoded.
        release: drops the ledger's raw charge of the holder (called once encoded).
        kept: bytes the ledger charged for holding it raw.
        tensor_bytes: bytes of the tensor itself (the meter's ``tensor_bytes``).
    """

    __slots__ = ("holder", "kept", "numel", "offset", "part", "release", "shape", "site")
    __slots__ += ("tensor_bytes",)

    def __init__(
        self,
        holder: weakref.ReferenceType,
        site: str,
        part: torch.Tensor,
        release: Callable[[], object],
        kept: int,
        tensor_bytes: int,
    ) -> None:
        self.holder = holder
        self.site = site
        self.part: torch.Tensor | None = part
        self.release = release
        self.kept = kept
        self.tensor_bytes = tensor_bytes
        self.shape = tuple(part.shape)
        self.numel = part.numel()
        self.offset = 0  # where its values start in the chunk (set by Chunk.add)


class Chunk:
    """Small tensors of one step sharing one codec, dtype and device; the ledger charges
    its packed bytes to the chunk itself, which its holders keep alive.

    Example:
        >>> from lightning_acgc.codecs.quant import QuantCodec, QuantConfig
        >>> chunk = Chunk(QuantCodec(QuantConfig(bits=8)), seed=0)
        >>> class Holder: ...
        >>> h = Holder()
        >>> x = torch.rand(300)
        >>> m = chunk.add(Member(weakref.ref(h), "s:0", x, lambda: None, 1200, 1200))
        >>> chunk.encode().nbytes < x.nbytes
        True
        >>> bool((chunk.take(m.offset, 300) - x).abs().max() < 0.01)
        True
    """

    __slots__ = ("__weakref__", "align", "codec", "decoded", "expected", "members", "numel")
    __slots__ += ("packed", "remaining", "seed")

    def __init__(self, codec: Codec, seed: int) -> None:
        self.codec = codec
        self.seed = seed
        self.align = alignment(codec)
        self.members: list[Member] = []
        self.numel = 0  # elements of the encoded buffer, padding included
        self.packed: Packed | None = None
        self.decoded: torch.Tensor | None = None
        self.expected = 0  # unpacks of one backward
        self.remaining = 0  # unpacks left in this backward

    def add(self, member: Member) -> Member:
        """Append ``member`` (its offset set here) and expect one unpack of it."""
        member.offset = self.numel
        self.numel += _span(member, self.align)
        self.members.append(member)
        self.expect()
        return member

    def expect(self) -> None:
        """One more unpack per backward (a tensor added, or saved again by another op)."""
        self.expected += 1
        self.remaining += 1

    def buffer(self) -> torch.Tensor:
        """The values of the live members, each padded to the alignment with its last
        value (dead members' spans are filled likewise, from nothing: zeros)."""
        pieces = []
        at = 0
        for m in self.members:
            part = m.part
            if m.holder() is None or part is None:
                continue
            if m.offset > at:
                pieces.append(part.new_zeros(m.offset - at))
            flat = part.reshape(-1)
            pad = _span(m, self.align) - m.numel
            pieces.append(flat)
            if pad:
                pieces.append(flat[-1:].expand(pad))
            at = m.offset + m.numel + pad
        if self.numel > at and pieces:
            pieces.append(pieces[0].new_zeros(self.numel - at))
        return torch.cat(pieces) if pieces else torch.empty(0)

    def encode(self) -> Packed | None:
        """Encode the live members' values into :attr:`packed` (``None``: the codec
        declined; the caller keeps the members raw). Raises what the codec raises."""
        flat = self.buffer()
        if flat.numel() == 0:
            return None
        packed = self.codec.encode(flat, self.seed)
        if packed is None or packed.nbytes >= flat.numel() * flat.element_size():
            return None
        self.packed = packed
        return packed

    def take(self, offset: int, numel: int) -> torch.Tensor:
        """One unpack: the ``numel`` decoded values at ``offset`` (a view of the decoded
        chunk, which is kept until this backward has unpacked every member)."""
        assert self.packed is not None
        flat = self.decoded
        if flat is None:
            flat = self.codec.decode(self.packed).reshape(-1)
        self.remaining -= 1
        if self.remaining > 0:
            self.decoded = flat
        else:  # every unpack of this backward done; a second one decodes again
            self.decoded = None
            self.remaining = self.expected
        return flat[offset : offset + numel]

    def peek(self, offset: int, numel: int) -> torch.Tensor:
        """The values :meth:`take` gives, without using up an unpack."""
        assert self.packed is not None
        flat = self.decoded
        if flat is None:
            flat = self.codec.decode(self.packed).reshape(-1)
        return flat[offset : offset + numel]


def _span(m: Member, align: int) -> int:
    return -(-m.numel // align) * align


class Coalescer:
    """The open chunks of the engine and their accounting: a joining tensor is charged
    raw by the ledger; once its chunk is encoded, the chunk's packed bytes are charged to
    the chunk and the raw charges dropped, and the meter's site records get their share
    of the packed bytes (by span); a chunk the codec declines leaves its tensors raw.

    Args:
        ledger: charges raw and packed bytes (:class:`~lightning_acgc.engine.ledger.Ledger`).
        stats: the meter's counters of the current step.
        on_error: called with ``(site, codec, error)`` when a codec raises; re-raises to
            make the error fatal (``strict``), else the chunk's tensors stay raw.
        packed_log: list that receives each chunk's :class:`Packed` (tests), or ``None``.
    """

    def __init__(
        self,
        ledger: Any,
        stats: CompressionStats,
        on_error: Callable[[str, Codec, Exception], None],
        packed_log: list[Packed] | None = None,
    ) -> None:
        self.ledger = ledger
        self.stats = stats
        self.on_error = on_error
        self.packed_log = packed_log
        self.open: dict[tuple, Chunk] = {}

    def join(
        self,
        holder: Any,
        site: str,
        t: torch.Tensor,
        part: torch.Tensor,
        ref: Any,
        codec: Codec,
        seed: Callable[[], int],
    ) -> tuple[Chunk, Member]:
        """Hold ``t`` (whose compact part is ``part``) raw in ``holder`` until its chunk is
        encoded; a chunk that reaches :data:`CHUNK_NUMEL` elements is encoded now."""
        kept, release = self.ledger.hold_raw_until(holder, t, ref)
        key = (id(codec), t.dtype, t.device)
        chunk = self.open.get(key)
        if chunk is None:
            chunk = self.open[key] = Chunk(codec, seed())
        member = chunk.add(
            Member(weakref.ref(holder), site, part, release, kept, t.numel() * t.element_size())
        )
        if chunk.numel >= CHUNK_NUMEL:
            del self.open[key]
            self._finish(chunk)
        return chunk, member

    def flush(self) -> None:
        """Encode every open chunk."""
        chunks = list(self.open.values())
        self.open.clear()
        for chunk in chunks:
            self._finish(chunk)

    def close(self, why: str) -> None:
        """Leave the tensors of every open chunk raw (counted as kept for ``why``)."""
        chunks = list(self.open.values())
        self.open.clear()
        for chunk in chunks:
            self._keep(chunk.members, why)
            chunk.members = []

    def _keep(self, members: list[Member], why: str) -> None:
        stats = self.stats
        for m in members:
            stats.tensors_kept += 1
            stats.packed_bytes += m.kept
            rec = stats.sites.get(m.site)
            if rec is not None:
                rec.codec, rec.settings = "kept", why
                rec.packed_bytes += m.kept
            m.part = None

    def _finish(self, chunk: Chunk) -> None:
        name, members = chunk.codec.name, chunk.members
        try:
            packed = chunk.encode()
        except Exception as err:
            chunk.members = []
            self._keep(members, f"{name} declined")
            self.on_error(members[0].site, chunk.codec, err)
            return
        chunk.members = []  # each holder keeps its own member
        if packed is None:
            self._keep(members, f"{name} declined or not smaller")
            return
        live, dead = [], []
        for m in members:
            holder = m.holder()
            (dead if holder is None else live).append((m, holder))
        self._keep([m for m, _ in dead], "freed before encoding")
        nbytes = packed.nbytes
        self.ledger.hold_packed(chunk, nbytes)
        stats = self.stats
        stats.packed_bytes += nbytes
        stats.tensors_packed += len(live)
        total = sum(_span(m, chunk.align) for m, _ in live)
        given = 0
        for i, (m, holder) in enumerate(live):
            share = (
                nbytes - given if i == len(live) - 1 else nbytes * _span(m, chunk.align) // total
            )
            given += share
            holder.raw = None
            m.part = None
            m.release()
            rec = stats.sites.get(m.site)
            if rec is not None:
                rec.packed_bytes += share
                rec.tensor_bytes += m.tensor_bytes
        if self.packed_log is not None:
            self.packed_log.append(packed)
