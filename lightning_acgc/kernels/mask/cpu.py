"""Compiled CPU path of the ``mask`` codec (``common/csrc/mask.c``), bit-identical to
:mod:`lightning_acgc.kernels.mask.reference`."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads

__all__ = [
    "mask_affine_cpu",
    "mask_pack_cpu",
    "mask_positive_cpu",
    "mask_select_cpu",
    "mask_two_cpu",
    "mask_unpack_cpu",
]


def mask_pack_cpu(mask: torch.Tensor) -> torch.Tensor:
    """Pack a CPU bool tensor into ``ceil(numel / 8)`` bytes (layout of the reference)."""
    m = mask.contiguous().reshape(-1).view(torch.uint8)
    out = torch.empty(-(-m.numel() // 8), dtype=torch.uint8)
    if m.numel():
        cpu_library().acgc_mask_pack(m.data_ptr(), m.numel(), out.data_ptr(), cpu_threads())
    return out


def mask_positive_cpu(x: torch.Tensor) -> torch.Tensor:
    """:func:`~lightning_acgc.kernels.mask.reference.mask_positive_ref` of a float32 CPU
    tensor in one pass (no bool tensor in between; bit-identical)."""
    x = x.contiguous().reshape(-1)
    out = torch.empty(-(-x.numel() // 8), dtype=torch.uint8)
    if x.numel():
        cpu_library().acgc_mask_positive_f32(x.data_ptr(), x.numel(), out.data_ptr(), cpu_threads())
    return out


def mask_two_cpu(x: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, int]:
    """:func:`~lightning_acgc.kernels.mask.reference.mask_two_ref` of a float32 CPU
    tensor in one pass (bit-identical)."""
    x = x.contiguous().reshape(-1)
    out = torch.empty(-(-x.numel() // 8), dtype=torch.uint8)
    if not x.numel():
        return out, 0
    lib = cpu_library()
    other = lib.acgc_mask_two_f32(x.data_ptr(), x.numel(), lo, hi, out.data_ptr(), cpu_threads())
    return out, int(other)


def mask_select_cpu(packed: torch.Tensor, numel: int, lo: float, hi: float) -> torch.Tensor:
    """:func:`~lightning_acgc.kernels.mask.reference.mask_select_ref` in one pass."""
    if packed.numel() * 8 < numel:
        raise ValueError(f"numel={numel} does not fit in {packed.numel()} packed bytes")
    packed = packed.contiguous()
    out = torch.empty(numel, dtype=torch.float32)
    if numel:
        lib = cpu_library()
        lib.acgc_mask_select_f32(packed.data_ptr(), numel, lo, hi, out.data_ptr(), cpu_threads())
    return out


def mask_unpack_cpu(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` bits of ``packed`` as a flat bool tensor."""
    if packed.numel() * 8 < numel:
        raise ValueError(f"numel={numel} does not fit in {packed.numel()} packed bytes")
    packed = packed.contiguous()
    out = torch.empty(numel, dtype=torch.uint8)
    if numel:
        cpu_library().acgc_mask_unpack(packed.data_ptr(), numel, out.data_ptr(), cpu_threads())
    return out.view(torch.bool)


def mask_affine_cpu(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    packed: torch.Tensor,
    tiny: float,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~lightning_acgc.kernels.mask.reference.mask_affine_ref` in one pass over a
    float32 ``x`` (bit-identical)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.shape[0] * x.shape[1] if x.dim() >= 2 else 0
    if out.numel():
        f32 = torch.float32  # C reads float32 factors, whatever the parameters' dtype
        scale, shift = scale.to(f32).contiguous(), shift.to(f32).contiguous()
        packed = packed.contiguous()
        add = None if addend is None else addend.to(x.dtype).contiguous()
        cpu_library().acgc_mask_affine_f32(
            x.data_ptr(), rows, x.shape[1], x.numel() // rows, scale.data_ptr(),
            shift.data_ptr(), None if add is None else add.data_ptr(), packed.data_ptr(),
            tiny, out.data_ptr(), cpu_threads(),
        )  # fmt: skip
    return out
