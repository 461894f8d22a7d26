"""Block-average pooling and upsampling of the ``division`` codec (the pooled axes, the
tile sums in tile order, the broadcast residual), the pure-torch specification shared by
:mod:`lightning_acgc.kernels.division.reference` and the compiled and Triton paths."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = [
    "check_block_axes",
    "division_lowpass_ref",
    "division_upsample_ref",
    "pool_axes",
    "pool_axis",
    "with_upsampled",
]


def pool_axes(ndim: int) -> tuple[int, ...]:
    """Axes pooled for a tensor of ``ndim`` dimensions.

    4-D and wider: every axis after the first two (H, W for NCHW; D, H, W for NCDHW);
    3-D (N, L, D): axis 1; 2-D and 1-D: the last axis; 0-d: none.
    """
    if ndim >= 4:
        return tuple(range(2, ndim))
    if ndim == 3:
        return (1,)
    if ndim >= 1:
        return (ndim - 1,)
    return ()


def check_block_axes(ndim: int, block: int, axes: Sequence[int] | None) -> tuple[int, ...]:
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block={block!r} must be an integer > 0")
    if axes is None:
        return pool_axes(ndim)
    norm = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axes={tuple(axes)!r}: axis {a} is out of range for {ndim}-D")
        norm.append(a % ndim)
    if len(set(norm)) != len(norm):
        raise ValueError(f"axes={tuple(axes)!r} repeats an axis")
    return tuple(sorted(norm))


def pool_axis(t: torch.Tensor, axis: int, block: int, acc: torch.dtype) -> torch.Tensor:
    """Averages of ``block`` consecutive entries along ``axis`` (the tail over its size).

    Tile sums are taken in tile order (0 + x0 + x1 + ...), so that every implementation
    (CPU, CUDA, Triton) gets the same bits; ``torch.sum`` promises no order.
    """
    size = t.shape[axis]
    if size == 0:  # empty axis
        return t.to(acc)
    full, rem = divmod(size, block)
    parts = []
    for start, count, n in ((0, full * block, block), (full * block, rem, rem)):
        if count == 0:
            continue
        tiles = t.narrow(axis, start, count).unflatten(axis, (count // n, n))
        total = torch.zeros_like(tiles.select(axis + 1, 0), dtype=acc)
        for k in range(n):
            total = total + tiles.select(axis + 1, k)
        parts.append(total.div_(n))
    return parts[0] if len(parts) == 1 else torch.cat(parts, axis)


def division_lowpass_ref(
    x: torch.Tensor,
    block: int,
    axes: Sequence[int] | None = None,
    one_axis: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Block average pool of ``x`` over ``axes`` (default :func:`pool_axes`).

    Each pooled axis of size ``L`` becomes ``ceil(L / block)``; a partial tile at the edge
    is averaged over its real elements. The pooling is separable, so it is done one axis
    at a time (last axis first), each pass on an already shrunk tensor: ``one_axis``
    (default :func:`pool_axis`; a compiled one computes the same bits).

    Returns:
        float32 averages (float64 for a float64 input).

    Raises:
        ValueError: ``block`` is not a positive integer, or ``axes`` is out of range.
    """
    axes = check_block_axes(x.ndim, block, axes)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    one_axis = one_axis or pool_axis
    out = x
    for axis in reversed(axes):
        out = one_axis(out, axis, block, acc)
    return out.to(acc, copy=True) if out is x else out


def division_upsample_ref(
    low: torch.Tensor,
    shape: Sequence[int],
    block: int,
    axes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Inverse layout of :func:`division_lowpass_ref`: every tile filled with its average.

    Args:
        low: the pooled tensor.
        shape: the shape of the tensor that was pooled.
        block: the tile edge used for pooling.
        axes: the pooled axes (default :func:`pool_axes` of ``len(shape)``).

    Returns:
        A tensor of ``shape`` and ``low.dtype`` (a view of a fresh tensor).

    Raises:
        ValueError: ``low`` does not have the pooled shape of ``shape``.
    """
    shape = tuple(shape)
    axes = check_block_axes(len(shape), block, axes)
    expected = tuple(-(-s // block) if i in axes else s for i, s in enumerate(shape))
    if tuple(low.shape) != expected:
        raise ValueError(
            f"low has shape {tuple(low.shape)}; pooling {shape} over axes {axes} with "
            f"block={block} gives {expected}"
        )
    view, expand, padded = [], [], []
    for i, s in enumerate(expected):
        view.append(s)
        expand.append(s)
        if i in axes:
            view.append(1)
            expand.append(block)
            padded.append(s * block)
        else:
            padded.append(s)
    up = low.reshape(view).expand(expand).reshape(padded)
    for axis in axes:
        if up.shape[axis] != shape[axis]:
            up = up.narrow(axis, 0, shape[axis])
    return up


def _tile_shapes(
    shape: Sequence[int], block: int, axes: tuple[int, ...]
) -> tuple[list[int], list[int]] | None:
    """(tiled shape of x, broadcast shape of low) when every pooled axis is whole tiles."""
    tiled, bcast = [], []
    for i, s in enumerate(shape):
        if i in axes:
            if s % block:
                return None
            tiled += [s // block, block]
            bcast += [s // block, 1]
        else:
            tiled.append(s)
            bcast.append(s)
    return tiled, bcast


def with_upsampled(
    t: torch.Tensor, low: torch.Tensor, block: int, axes: tuple[int, ...], subtract: bool
) -> torch.Tensor:
    """``t -/+ upsample(low)`` as a fresh contiguous tensor; one broadcast pass when the
    pooled axes are whole tiles."""
    shapes = _tile_shapes(t.shape, block, axes)
    if shapes is None:
        up = division_upsample_ref(low, t.shape, block, axes)
        return t - up if subtract else t + up
    tiled, bcast = shapes
    tt, lb = t.reshape(tiled), low.reshape(bcast)
    return (tt - lb if subtract else tt + lb).view(t.shape)
