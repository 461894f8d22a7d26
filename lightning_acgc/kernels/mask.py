"""1-bit lossless packing of boolean tensors — pure-torch reference and CPU path.

Format: ``bits``: uint8, bit ``i % 8`` of byte ``i // 8`` is element ``i`` (flat, row-major),
the tail padded with zeros. The Triton kernels write the same layout.
"""

from __future__ import annotations

import torch

from lightning_acgc.kernels.bitpack import pack_codes, unpack_codes
from lightning_acgc.kernels.dispatch import use_triton

__all__ = ["mask_pack", "mask_pack_ref", "mask_unpack", "mask_unpack_ref"]


def mask_pack_ref(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (any shape) into ceil(numel / 8) bytes."""
    flat = mask.reshape(-1).view(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return pack_codes(flat, 1)


def mask_unpack_ref(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Flat bool tensor of the first ``numel`` bits."""
    return unpack_codes(packed, 1, numel).view(torch.bool)


def mask_pack(mask: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Pack through Triton or the torch reference (see :func:`use_triton`)."""
    if use_triton(mask, backend):
        from lightning_acgc.kernels.mask_triton import mask_pack_triton

        return mask_pack_triton(mask.contiguous())
    return mask_pack_ref(mask)


def mask_unpack(packed: torch.Tensor, numel: int, backend: str = "auto") -> torch.Tensor:
    """Unpack through Triton or the torch reference (see :func:`use_triton`)."""
    if use_triton(packed, backend):
        from lightning_acgc.kernels.mask_triton import mask_unpack_triton

        return mask_unpack_triton(packed, numel)
    return mask_unpack_ref(packed, numel)
