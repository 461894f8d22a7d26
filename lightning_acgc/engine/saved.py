"""What autograd holds for each saved tensor while the compression hooks are on."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_acgc.codecs.base import Codec, Packed
from lightning_acgc.engine.coalesce import Chunk, Member
from lightning_acgc.engine.layout import Layout, restore

__all__ = ["Saved"]


class Saved:
    """What autograd holds instead of a saved tensor: its packed form, or the tensor
    itself (``raw``, detached: returning a saved output with its ``grad_fn`` would make
    a reference cycle through autograd's C++ graph that no garbage collection frees).
    The ledger charges it when made and releases it when autograd drops it.

    A tensor saved by several ops (a ReLU output that is also the next conv's input) is
    packed once and handed out ``pending`` times; backward decodes it once and keeps the
    decoded tensor until the last of those unpacks (or until the graph is freed, if some
    op never unpacks it). The decoded tensor has the sizes and strides that autograd saved
    (``layout``; see :mod:`lightning_acgc.engine.layout`).

    A reduction result whose backward compares it with its inputs (``amax`` and the
    others of :mod:`lightning_acgc.engine.exact`) stores nothing: ``recompute`` makes it
    from the values its inputs' holders ``sources`` unpack (:meth:`peek`; a tensor the
    engine handed back as it is stands for itself). So does a derived output
    (:mod:`lightning_acgc.engine.derive`), whose sources may end with a stored mask (a
    ReLU's, packed bits). A recomputed tensor, like a decoded one, is kept until the last
    of its unpacks. So are the sources it decoded to make it (decoded once), unless
    ``keep_sources`` is off (:class:`~lightning_acgc.engine.EngineSettings`'s
    ``low_peak``): each source is then decoded again at its own unpack, and is not held
    decoded in between (a block's input, read by a residual sum remade at the end of the
    next block's backward, was held through the whole of its own block's). ``patches``
    are applied to the decoded or recomputed values (an input of a max reduction: its
    exact maxima, :mod:`lightning_acgc.engine.extremum`).
    """

    __slots__ = (
        "__weakref__",
        "chunk",
        "codec",
        "decoded",
        "keep_sources",
        "layout",
        "member",
        "name",
        "packed",
        "patches",
        "pending",
        "raw",
        "recompute",
        "site",
        "sources",
    )

    def __init__(
        self,
        packed: Packed | None,
        codec: Codec | None,
        site: str,
        name: str,
        raw: torch.Tensor | None = None,
        layout: Layout | None = None,
        sources: tuple[Saved | torch.Tensor, ...] = (),
        recompute: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.packed = packed
        self.codec = codec
        self.raw: torch.Tensor | None = raw
        self.name = name
        self.site = site
        self.layout = layout
        self.pending = 1
        self.decoded: torch.Tensor | None = None
        self.chunk: Chunk | None = None  # a small tensor encoded with others
        self.member: Member | None = None
        self.sources = sources
        self.recompute = recompute
        self.keep_sources = True  # a recomputed tensor's sources stay decoded (see above)
        self.patches: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()

    def unpack(self) -> torch.Tensor:
        return self._values(consume=True)

    def peek(self, keep: bool = True) -> torch.Tensor:
        """The values :meth:`unpack` gives, without using up an unpack (for a result
        recomputed from them); a decoded tensor is kept for the unpacks still to come
        (``keep=False``: not kept, decoded again at the next unpack)."""
        return self._values(consume=False, keep=keep)

    def _values(self, consume: bool, keep: bool = True) -> torch.Tensor:
        if self.raw is not None:
            return self.raw
        if self.chunk is not None:
            m, chunk = self.member, self.chunk
            assert m is not None
            flat = chunk.take(m.offset, m.numel) if consume else chunk.peek(m.offset, m.numel)
            return self._patched(restore(flat.view(m.shape), self.layout))
        out = self.decoded  # decoded or recomputed: kept for the unpacks still to come
        if out is None and self.recompute is not None:
            out = self.recompute(*(_peek(s, self.keep_sources) for s in self.sources))
        elif out is None:
            assert self.codec is not None and self.packed is not None
            out = restore(self.codec.decode(self.packed), self.layout)
        if self.decoded is None:
            out = self._patched(out)
            if not (consume or keep):
                return out
        self.pending -= int(consume)
        self.decoded = out if self.pending > 0 else None
        return out

    def _patched(self, values: torch.Tensor) -> torch.Tensor:
        for patch in self.patches:
            values = patch(values)
        return values


def _peek(source: Saved | torch.Tensor, keep: bool) -> torch.Tensor:
    return source.peek(keep) if isinstance(source, Saved) else source
