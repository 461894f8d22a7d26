"""1-bit lossless packing of boolean tensors — pure-torch reference (the specification).

Format: ``bits``: uint8, bit ``i % 8`` of byte ``i // 8`` is element ``i`` (flat, row-major),
the tail padded with zeros. The Triton kernels write the same layout.
"""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.bitpack import pack_codes, unpack_codes

__all__ = ["mask_pack_ref", "mask_unpack_ref"]


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
