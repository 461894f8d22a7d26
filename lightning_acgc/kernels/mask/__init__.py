"""``mask`` kernels: 1-bit lossless packing of bool tensors, routed to Triton (CUDA), the
compiled CPU path, or the pure-torch reference (see
:func:`lightning_acgc.kernels.common.dispatch.route`)."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.dispatch import route
from lightning_acgc.kernels.mask.cpu import (
    mask_affine_cpu,
    mask_pack_cpu,
    mask_positive_cpu,
    mask_select_cpu,
    mask_two_cpu,
    mask_unpack_cpu,
)
from lightning_acgc.kernels.mask.reference import (
    mask_affine_ref,
    mask_pack_ref,
    mask_positive_ref,
    mask_select_ref,
    mask_two_ref,
    mask_unpack_ref,
)

__all__ = [
    "mask_affine",
    "mask_affine_ref",
    "mask_pack",
    "mask_pack_ref",
    "mask_positive",
    "mask_positive_ref",
    "mask_select",
    "mask_select_ref",
    "mask_two_ref",
    "mask_two_valued",
    "mask_unpack",
    "mask_unpack_ref",
]

_TRITON = "lightning_acgc.kernels.mask.triton"


def mask_pack(mask: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Pack a bool tensor into ``ceil(numel / 8)`` bytes.

    Example:
        >>> mask_pack(torch.tensor([True, False, True])).tolist()
        [5]
    """
    fn = route(mask, backend, mask_pack_ref, f"{_TRITON}:mask_pack_triton", mask_pack_cpu)
    return fn(mask.contiguous() if fn is not mask_pack_ref else mask)


def mask_positive(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The packed mask of a ReLU's input, ``mask_pack(~(x <= 0))`` (positive or NaN: a
    NaN passes the ReLU as NaN): on the CPU one pass over a float32 ``x``, elsewhere
    the comparison and :func:`mask_pack` (Triton on CUDA).

    Example:
        >>> mask_positive(torch.tensor([1.0, -2.0, float("nan"), 0.0])).tolist()
        [5]
    """
    cpu = mask_positive_cpu if x.dtype == torch.float32 else None
    fn = route(x, backend, mask_positive_ref, None, cpu)
    if fn is mask_positive_ref:
        return mask_pack(~(x <= 0), backend)
    return fn(x)


def mask_unpack(packed: torch.Tensor, numel: int, backend: str = "auto") -> torch.Tensor:
    """The first ``numel`` bits of ``packed`` as a flat bool tensor.

    Example:
        >>> mask_unpack(torch.tensor([5], dtype=torch.uint8), 3).tolist()
        [True, False, True]
    """
    fn = route(packed, backend, mask_unpack_ref, f"{_TRITON}:mask_unpack_triton", mask_unpack_cpu)
    return fn(packed, numel)


def mask_two_valued(
    x: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where the floating tensor ``x`` holds at most two distinct values, none NaN (a
    dropout's float mask): the packed bits of ``x == max`` (:func:`mask_pack`'s layout)
    and the values ``[min, max]`` in ``x``'s dtype; None otherwise. A float32 CPU
    tensor takes one compiled pass after its min and max; elsewhere torch ops and
    :func:`mask_pack`.

    Example:
        >>> bits, values = mask_two_valued(torch.tensor([0.0, 2.0, 2.0]))
        >>> bits.tolist(), values.tolist()
        ([6], [0.0, 2.0])
        >>> mask_two_valued(torch.tensor([0.0, 1.0, 2.0])) is None
        True
    """
    lo, hi = torch.aminmax(x)
    values = torch.stack([lo, hi])
    compiled = x.dtype == torch.float32
    if compiled and route(x, backend, mask_two_ref, None, mask_two_cpu) is mask_two_cpu:
        bits, other = mask_two_cpu(x, float(lo), float(hi))
        return None if other else (bits, values)
    is_hi = x == hi
    if not bool((is_hi | (x == lo)).all()):  # NaN fails both tests
        return None
    return mask_pack(is_hi, backend), values


def mask_select(
    packed: torch.Tensor, numel: int, values: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """The inverse of :func:`mask_two_valued`: a flat tensor of ``numel`` values,
    ``values[1]`` where the bit is set, else ``values[0]`` (one compiled pass for
    float32 on the CPU).

    Example:
        >>> mask_select(torch.tensor([6], dtype=torch.uint8), 3, torch.tensor([0.0, 2.0])).tolist()
        [0.0, 2.0, 2.0]
    """
    fn = route(packed, backend, mask_select_ref, None, mask_select_cpu)
    if values.dtype == torch.float32 and fn is mask_select_cpu:
        return mask_select_cpu(packed, numel, float(values[0]), float(values[1]))
    return torch.where(mask_unpack(packed, numel, backend), values[1], values[0])


def mask_affine(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    packed: torch.Tensor,
    tiny: float,
    addend: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """A ReLU's output remade from its BatchNorm's input ``x`` (channels in dimension 1)
    and the ReLU's exact mask ``packed`` (:func:`mask_pack` of ``y > 0``, flat order of
    ``x``): per channel ``x·scale + shift`` (plus ``addend``, a residual branch of ``x``'s
    shape, where given), at least ``tiny`` where the mask's bit is set (NaN stays NaN), 0
    elsewhere. The compiled CPU path for float32 (one pass); torch ops
    elsewhere (no Triton kernel: on a GPU they are bandwidth-bound already).

    Example:
        >>> x = torch.tensor([[-1.0, 2.0], [3.0, -4.0]])  # 2 rows, 2 channels
        >>> bits = mask_pack(torch.tensor([[False, True], [True, False]]))
        >>> mask_affine(x, torch.ones(2), torch.zeros(2), bits, 1e-30).tolist()
        [[0.0, 2.0], [3.0, 0.0]]
    """
    cpu = mask_affine_cpu if x.dtype == torch.float32 and x.dim() >= 2 else None
    fn = route(x, backend, mask_affine_ref, None, cpu)
    return fn(x, scale, shift, packed, tiny, addend)
