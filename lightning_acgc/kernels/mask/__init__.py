"""``mask`` kernels: 1-bit lossless packing of bool tensors, routed to Triton (CUDA), the
compiled CPU path, or the pure-torch reference (see
:func:`lightning_acgc.kernels.common.dispatch.route`)."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.dispatch import route
from lightning_acgc.kernels.mask.cpu import mask_pack_cpu, mask_unpack_cpu
from lightning_acgc.kernels.mask.reference import mask_pack_ref, mask_unpack_ref

__all__ = ["mask_pack", "mask_pack_ref", "mask_unpack", "mask_unpack_ref"]

_TRITON = "lightning_acgc.kernels.mask.triton"


def mask_pack(mask: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Pack a bool tensor into ``ceil(numel / 8)`` bytes.

    Example:
        >>> mask_pack(torch.tensor([True, False, True])).tolist()
        [5]
    """
    fn = route(mask, backend, mask_pack_ref, f"{_TRITON}:mask_pack_triton", mask_pack_cpu)
    return fn(mask.contiguous() if fn is not mask_pack_ref else mask)


def mask_unpack(packed: torch.Tensor, numel: int, backend: str = "auto") -> torch.Tensor:
    """The first ``numel`` bits of ``packed`` as a flat bool tensor.

    Example:
        >>> mask_unpack(torch.tensor([5], dtype=torch.uint8), 3).tolist()
        [True, False, True]
    """
    fn = route(packed, backend, mask_unpack_ref, f"{_TRITON}:mask_unpack_triton", mask_unpack_cpu)
    return fn(packed, numel)
