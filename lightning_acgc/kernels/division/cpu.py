"""CPU path of the ``division`` codec: the reference's encoder and decoder with the compiled
steps of ``common/fastcpu.c`` (the quant and mask kernels of
:mod:`lightning_acgc.kernels.quant.cpu` and :mod:`lightning_acgc.kernels.mask.cpu`, the
last-axis pooling, the zero pattern in one pass, and the decode's clamp and zero mask in
one pass); the same payload and values as the reference."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads
from lightning_acgc.kernels.division.pooling import pool_axis
from lightning_acgc.kernels.division.reference import (
    Kernels,
    division_decode_with,
    division_encode_with,
)
from lightning_acgc.kernels.mask.cpu import mask_pack_cpu, mask_unpack_cpu
from lightning_acgc.kernels.quant.cpu import quant_decode_cpu, quant_encode_cpu

__all__ = ["CPU_KERNELS", "division_decode_cpu", "division_encode_cpu"]


def _pool_axis_cpu(t: torch.Tensor, axis: int, block: int, acc: torch.dtype) -> torch.Tensor:
    """The reference's one-axis pooling; the last axis of a float32 tensor in C."""
    if axis != t.ndim - 1 or t.dtype != torch.float32 or acc != torch.float32 or t.numel() == 0:
        return pool_axis(t, axis, block, acc)
    src = t.contiguous()
    w = t.shape[-1]
    out = torch.empty((*t.shape[:-1], -(-w // block)), dtype=torch.float32)
    lib = cpu_library()
    lib.acgc_pool_last(src.data_ptr(), src.numel() // w, w, block, out.data_ptr(), cpu_threads())
    return out


def _zero_pattern_cpu(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`~lightning_acgc.kernels.division.reference.zero_pattern` in one pass (float32
    ``x``)."""
    x = x.contiguous()
    n = x.numel()
    packed = torch.empty((n + 7) // 8, dtype=torch.uint8)
    min_pos = torch.empty(1, dtype=torch.float32)
    cpu_library().acgc_zero_pattern(
        x.data_ptr(), n, packed.data_ptr(), min_pos.data_ptr(), cpu_threads()
    )
    return {"zero_mask": packed, "min_pos": min_pos}


def _finish_cpu(out: torch.Tensor, fmax: float, payload: dict[str, torch.Tensor]) -> torch.Tensor:
    """Clamp to +-fmax and apply the zero pattern, in place, in one pass."""
    out = out.contiguous()
    zmask = payload.get("zero_mask")
    if zmask is not None:
        zmask = zmask.contiguous()
        min_pos = float(payload["min_pos"])
    cpu_library().acgc_division_finish(
        out.data_ptr(), out.numel(), fmax, None if zmask is None else zmask.data_ptr(),
        min_pos if zmask is not None else 0.0, cpu_threads(),
    )  # fmt: skip
    return out


CPU_KERNELS = Kernels(
    quant_encode_cpu,
    quant_decode_cpu,
    mask_pack_cpu,
    mask_unpack_cpu,
    pool_axis=_pool_axis_cpu,
    zero_pattern=_zero_pattern_cpu,
    finish=_finish_cpu,
)


def division_encode_cpu(
    x: torch.Tensor,
    block: int,
    residual_bits: int,
    group_size: int,
    low_dtype: torch.dtype,
    seed: int,
) -> dict[str, torch.Tensor]:
    """Encode a non-empty CPU floating tensor (payload of ``division_encode_ref``)."""
    return division_encode_with(CPU_KERNELS, x, block, residual_bits, group_size, low_dtype, seed)


def division_decode_cpu(
    payload: dict[str, torch.Tensor],
    shape: Sequence[int],
    dtype: torch.dtype,
    block: int,
    residual_bits: int,
    group_size: int,
) -> torch.Tensor:
    """Decode a payload (of any path) on the CPU."""
    args = (payload, shape, dtype, block, residual_bits, group_size)
    return division_decode_with(CPU_KERNELS, *args)
