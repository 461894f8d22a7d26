"""1-bit lossless packing of boolean tensors — pure-torch reference (the specification).

Format: ``bits``: uint8, bit ``i % 8`` of byte ``i // 8`` is element ``i`` (flat, row-major),
the tail padded with zeros. The Triton kernels write the same layout.
"""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.bitpack import pack_codes, unpack_codes

__all__ = [
    "mask_affine_ref",
    "mask_pack_ref",
    "mask_positive_ref",
    "mask_select_ref",
    "mask_two_ref",
    "mask_unpack_ref",
]


def mask_pack_ref(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (any shape) into ceil(numel / 8) bytes."""
    flat = mask.reshape(-1).view(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return pack_codes(flat, 1)


def mask_positive_ref(x: torch.Tensor) -> torch.Tensor:
    """The packed mask of a ReLU's input: bit set where ``x`` is positive or NaN
    (``~(x <= 0)``), in :func:`mask_pack_ref`'s layout."""
    return mask_pack_ref(~(x <= 0))


def mask_unpack_ref(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Flat bool tensor of the first ``numel`` bits."""
    return unpack_codes(packed, 1, numel).view(torch.bool)


def mask_two_ref(x: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, int]:
    """A two-valued tensor's bits, :func:`mask_pack_ref` of ``x == hi``, and how many of
    its values equal neither ``lo`` nor ``hi`` (NaN equals neither)."""
    is_hi = x == hi
    other = int((~(is_hi | (x == lo))).sum())
    return mask_pack_ref(is_hi), other


def mask_select_ref(packed: torch.Tensor, numel: int, lo: float, hi: float) -> torch.Tensor:
    """The inverse of :func:`mask_two_ref`: a flat float32 tensor, ``hi`` where bit ``i``
    is set, else ``lo``."""
    flags = mask_unpack_ref(packed, numel)
    return torch.where(
        flags, torch.tensor(hi, dtype=torch.float32), torch.tensor(lo, dtype=torch.float32)
    )


def mask_affine_ref(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    packed: torch.Tensor,
    tiny: float,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """A ReLU's output remade from its BatchNorm's input ``x`` (channels in dimension 1)
    and its exact mask ``packed`` (bits, flat order of ``x``): ``x·scale + shift`` per
    channel (plus ``addend``, a residual branch of ``x``'s shape, where given), at least
    ``tiny`` where the mask's bit is set (NaN stays NaN), else 0."""
    shape = (1, -1, *(1,) * (x.dim() - 2))
    out = (x * scale.view(shape)).add_(shift.view(shape))
    if addend is not None:
        out.add_(addend)
    keep = mask_unpack_ref(packed, x.numel()).view(x.shape)
    return out.clamp_min_(tiny).masked_fill_(~keep, 0.0)
