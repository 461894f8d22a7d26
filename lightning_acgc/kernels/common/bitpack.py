"""Pure-torch bit packing: b-bit codes (b in 1..8) to bytes and back.

Layout: a little-endian bit stream, code ``i`` at bits ``[b*i, b*i + b)``. For b in
1, 2, 4, 8 that is code ``k`` of a byte's ``8 // b`` codes at bit offset ``b * k``; for
the other widths 8 codes fill ``b`` bytes. The compiled CPU path and the Triton kernels
write the same layout.
"""

from __future__ import annotations

import torch

__all__ = ["pack_codes", "unpack_codes"]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of ``bits``-bit codes; its length must be a multiple of 8.

    Example:
        >>> pack_codes(torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8), 3).tolist()
        [209, 88, 31]
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.contiguous()
    if codes.numel() % 8:
        raise ValueError(f"{codes.numel()} codes do not fill whole bytes at {bits} bits")
    if 8 % bits == 0:
        per = 8 // bits
        c = codes.view(-1, per)
        out = c[:, 0].clone()
        for i in range(1, per):
            out |= c[:, i] << (bits * i)
        return out
    # 8 codes -> one integer of 8 * bits <= 56 bits -> its ``bits`` low bytes
    c = codes.view(-1, 8).to(torch.int64)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=codes.device)
    word = (c << shifts).sum(dim=1)
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=codes.device)
    return ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).view(-1)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes as uint8."""
    if bits == 8:
        return packed[:numel]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(1) >> shifts) & mask
        return codes.view(-1)[:numel]
    b = packed.view(-1, bits).to(torch.int64)
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=packed.device)
    word = (b << byte_shifts).sum(dim=1)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=packed.device)
    codes = ((word[:, None] >> shifts) & mask).to(torch.uint8)
    return codes.view(-1)[:numel]
