"""Triton kernels of the ``mask`` codec: 1-bit pack and unpack of boolean tensors, in the
layout of :mod:`lightning_acgc.kernels.mask.reference` (bit ``i % 8`` of byte ``i // 8`` is element
``i``, tail bits zero). Lossless and deterministic: bit-identical to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from lightning_acgc.kernels.common.triton_utils import (
    LAUNCH_OPTIONS,
    check_contiguous,
    check_device,
    check_dtype,
    eager_or_op,
    rows_per_program,
)

__all__ = ["mask_pack_triton", "mask_unpack_triton"]


@triton.jit
def _mask_pack_kernel(
    mask_ptr,  # *u8 [numel] the bool mask's bytes (0 or 1)
    packed_ptr,  # *u8 [cdiv(numel, 8)] (out)
    numel,  # elements of the mask
    n_bytes,  # cdiv(numel, 8)
    BYTES: tl.constexpr,  # bytes per program, a power of two
    IDX64: tl.constexpr,  # element indices need 64 bits
):
    pid = tl.program_id(0)
    rows = pid * BYTES + tl.arange(0, BYTES)
    if IDX64:
        rows = rows.to(tl.int64)
    bit = tl.arange(0, 8)
    idx = rows[:, None] * 8 + bit[None, :]
    m = tl.load(mask_ptr + idx, mask=idx < numel, other=0)  # the tail reads as zeros
    packed = tl.sum((m != 0).to(tl.int32) << bit[None, :], axis=1)
    tl.store(packed_ptr + rows, packed.to(tl.uint8), mask=rows < n_bytes)


@triton.jit
def _mask_unpack_kernel(
    packed_ptr,  # *u8 [>= cdiv(numel, 8)] packed bits
    out_ptr,  # *u8 [numel] 0/1, the bytes of the bool output (out)
    numel,  # elements to write
    BYTES: tl.constexpr,  # bytes per program, a power of two
    IDX64: tl.constexpr,  # element indices need 64 bits
):
    pid = tl.program_id(0)
    rows = pid * BYTES + tl.arange(0, BYTES)
    if IDX64:
        rows = rows.to(tl.int64)
    bit = tl.arange(0, 8)
    idx = rows[:, None] * 8 + bit[None, :]
    ok = idx < numel
    byte = tl.load(packed_ptr + rows, mask=rows * 8 < numel, other=0).to(tl.int32)
    flags = (byte[:, None] >> bit[None, :]) & 1
    tl.store(out_ptr + idx, flags.to(tl.uint8), mask=ok)


@eager_or_op("lightning_acgc::mask_pack_core")
def _mask_pack_core(mask_u8: torch.Tensor) -> torch.Tensor:
    """One launch of the pack kernel on the mask's bytes (checked by the caller)."""
    numel = mask_u8.numel()
    n_bytes = triton.cdiv(numel, 8)
    packed = torch.empty(n_bytes, dtype=torch.uint8, device=mask_u8.device)
    block = rows_per_program(8, n_bytes)
    wrap_triton(_mask_pack_kernel)[(triton.cdiv(n_bytes, block),)](
        mask_u8,
        packed,
        numel,
        n_bytes,
        BYTES=block,
        IDX64=n_bytes * 8 + block * 8 >= 2**31,
        **LAUNCH_OPTIONS,
    )
    return packed


@eager_or_op("lightning_acgc::mask_unpack_core")
def _mask_unpack_core(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """One launch of the unpack kernel: ``numel`` 0/1 bytes (caller checked the sizes)."""
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    n_bytes = triton.cdiv(numel, 8)
    block = rows_per_program(8, n_bytes)
    wrap_triton(_mask_unpack_kernel)[(triton.cdiv(n_bytes, block),)](
        packed,
        out,
        numel,
        BYTES=block,
        IDX64=n_bytes * 8 + block * 8 >= 2**31,
        **LAUNCH_OPTIONS,
    )
    return out


def mask_pack_triton(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor into ``ceil(numel / 8)`` bytes, as
    :func:`~lightning_acgc.kernels.mask.reference.mask_pack_ref`.

    Args:
        mask: contiguous bool tensor, any shape, on a CUDA device (or any device under
            ``TRITON_INTERPRET=1``).

    Returns:
        Flat uint8 tensor of the packed bits.

    Raises:
        RuntimeError: Triton cannot run on ``mask``'s device.
        TypeError: ``mask`` is not bool.
        ValueError: ``mask`` is not contiguous.
    """
    check_device(mask, "mask")
    check_dtype(mask, "mask", (torch.bool,))
    check_contiguous(mask, "mask")
    if mask.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=mask.device)
    return _mask_pack_core(mask.reshape(-1).view(torch.uint8))


def mask_unpack_triton(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` bits of ``packed`` as a flat bool tensor, as
    :func:`~lightning_acgc.kernels.mask.reference.mask_unpack_ref`.

    Args:
        packed: contiguous uint8 tensor of at least ``ceil(numel / 8)`` bytes.
        numel: elements to unpack.

    Returns:
        Flat bool tensor of ``numel`` elements.

    Raises:
        RuntimeError: Triton cannot run on ``packed``'s device.
        TypeError: ``packed`` is not uint8.
        ValueError: ``packed`` is not contiguous or too short, or ``numel`` is negative.
    """
    check_device(packed, "packed")
    check_dtype(packed, "packed", (torch.uint8,))
    check_contiguous(packed, "packed")
    if numel < 0 or packed.numel() * 8 < numel:
        raise ValueError(
            f"numel={numel} does not fit in {packed.numel()} packed bytes "
            f"(need 0 <= numel <= {packed.numel() * 8})"
        )
    if numel == 0:
        return torch.empty(0, dtype=torch.bool, device=packed.device)
    return _mask_unpack_core(packed, numel).view(torch.bool)
