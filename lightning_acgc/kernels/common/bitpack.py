"""Pure-torch bit packing: b-bit codes (b in 1, 2, 4, 8) to bytes and back.

Layout: code ``i`` of a row of ``8 // b`` codes sits at bit offset ``b * i`` of its byte
(little-endian within the byte). The Triton kernels write the same layout.
"""

from __future__ import annotations

import torch

__all__ = ["pack_codes", "unpack_codes"]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of ``bits``-bit codes; its length must be a multiple of 8."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.contiguous()
    per = 8 // bits
    if codes.numel() % per:
        raise ValueError(f"{codes.numel()} codes do not fill whole bytes at {bits} bits")
    c = codes.view(-1, per)
    out = c[:, 0].clone()
    for i in range(1, per):
        out |= c[:, i] << (bits * i)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes as uint8."""
    if bits == 8:
        return packed[:numel]
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(1) >> shifts) & mask
    return codes.view(-1)[:numel]
