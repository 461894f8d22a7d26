"""The memory layout of a saved tensor: what to encode, and how to give the decoded
values back with the strides autograd saved.

Codecs see tensors by their logical shape and decode to a contiguous tensor. A saved
tensor may be channels_last, a transposed view or an expanded one; compiled backward
graphs (Inductor) assert the exact sizes and strides of what they saved, and eager
kernels pick their memory format from it. So the engine encodes the *compact* part of
the tensor (expanded dimensions narrowed to one element: their values repeat) and, on
decode, rebuilds the original sizes and strides (storage offset 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Layout", "compact", "restore"]


@dataclass(frozen=True)
class Layout:
    """Sizes and strides of a saved tensor whose layout is not the default contiguous one."""

    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def compact_size(self) -> tuple[int, ...]:
        """The sizes with every expanded dimension (stride 0) reduced to 1."""
        return tuple(1 if st == 0 else sz for sz, st in zip(self.size, self.stride, strict=True))


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for sz in reversed(size):
        strides.append(acc)
        acc *= max(sz, 1)
    return tuple(reversed(strides))


def _same_strides(size: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Equal strides on every dimension of more than one element."""
    return all(sz <= 1 or x == y for sz, x, y in zip(size, a, b, strict=True))


def _no_overlap(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether distinct indices reach distinct elements (a sufficient test)."""
    dims = sorted((st, sz) for sz, st in zip(size, stride, strict=True) if sz > 1)
    reach = 1
    for st, sz in dims:
        if st < reach:
            return False
        reach = st * sz
    return True


def compact(t: torch.Tensor) -> tuple[torch.Tensor, Layout | None]:
    """The part of ``t`` to encode and the layout to restore (``None``: the decoded
    contiguous tensor already has ``t``'s strides).

    Example:
        >>> x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
        >>> part, layout = compact(x)
        >>> restore(part.contiguous(), layout).stride() == x.stride()
        True
        >>> part, layout = compact(torch.randn(3, 1).expand(3, 1000))
        >>> tuple(part.shape), layout.stride
        ((3, 1), (1, 0))
    """
    size, stride = tuple(t.shape), t.stride()
    if stride == _contiguous_strides(size):
        return t, None
    part = t
    for dim, (sz, st) in enumerate(zip(size, stride, strict=True)):
        if st == 0 and sz > 1:
            part = part.narrow(dim, 0, 1)
    return part, Layout(size, stride)


def restore(decoded: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """``decoded`` (the compact part's values, any strides) with ``layout``'s sizes and
    strides; a tensor whose strides overlap in memory comes back with the right sizes
    and values but its own strides."""
    if layout is None:
        return decoded
    part_size = layout.compact_size
    part_stride = tuple(
        st if sz > 1 else 0 for sz, st in zip(part_size, layout.stride, strict=True)
    )
    if _same_strides(part_size, decoded.stride(), part_stride):
        return decoded.as_strided(layout.size, layout.stride, decoded.storage_offset())
    if not _no_overlap(part_size, part_stride):
        return decoded.expand(layout.size)
    out = torch.empty_strided(
        part_size, [max(st, 1) for st in part_stride], dtype=decoded.dtype, device=decoded.device
    )
    out.copy_(decoded)
    return out.as_strided(layout.size, layout.stride, 0)
