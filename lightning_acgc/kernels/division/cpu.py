"""CPU path of the ``division`` codec, the same payload and values as the reference.

Tensors of 1 to 4 dimensions (float32 averages, float32 or bfloat16 ``low``, quant groups of
at most 4096) take the fused kernels of ``common/csrc/division.c``: the encoder in two passes
(the block averages; then per quant group the residual in a buffer, quantized and packed,
with the group's zero bits), the decoder in one (per group: unpack, add the averages,
clamp, zero mask), with no full-size temporary. Other tensors, and the rare ones the fused
kernels decline (NaN/inf, float32 sums that overflow, averages that are subnormal or
beyond bfloat16), run the reference's encoder and decoder with the compiled steps (quant
and mask kernels, last-axis pooling, zero pattern, the decode's clamp and zero mask).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads
from lightning_acgc.kernels.common.nonfinite import restore_exceptions
from lightning_acgc.kernels.common.small import cpu_empty
from lightning_acgc.kernels.division.pooling import pool_axes, pool_axis
from lightning_acgc.kernels.division.reference import (
    Kernels,
    division_decode_with,
    division_encode_with,
)
from lightning_acgc.kernels.mask.cpu import mask_pack_cpu, mask_unpack_cpu
from lightning_acgc.kernels.quant.cpu import quant_decode_cpu, quant_encode_cpu
from lightning_acgc.kernels.quant.reference import hash_key

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
    zmask = None if zmask is None else zmask.contiguous()
    cpu_library().acgc_division_finish(
        out.data_ptr(), out.numel(), fmax, None if zmask is None else zmask.data_ptr(),
        _min_pos(payload), cpu_threads(),
    )  # fmt: skip
    return out


def _min_pos(payload: dict[str, torch.Tensor]) -> float:
    """The payload's floor for decoded values (-inf: none)."""
    return float(payload["min_pos"]) if "min_pos" in payload else -math.inf


CPU_KERNELS = Kernels(
    quant_encode_cpu,
    quant_decode_cpu,
    mask_pack_cpu,
    mask_unpack_cpu,
    pool_axis=_pool_axis_cpu,
    zero_pattern=_zero_pattern_cpu,
    finish=_finish_cpu,
)


_FUSED_MAX_GROUP = 4096  # the C kernels' CHUNK: a group's residual buffer


def _fused_view(shape: Sequence[int]) -> tuple[int, int, int, int, int] | None:
    """(planes, h, w, pool h, pool w): ``shape`` seen by the fused kernels as (everything
    before the last two axes, the second-last, the last), each of those two pooled where
    :func:`~lightning_acgc.kernels.division.pooling.pool_axes` pools it; None for 0-d
    tensors and where an earlier axis is pooled too (5-D and wider)."""
    ndim = len(shape)
    axes = pool_axes(ndim)
    if not axes or min(axes) < ndim - 2:
        return None
    *lead, h, w = (1, 1, *shape)
    return math.prod(lead), h, w, int(ndim - 2 in axes), int(ndim - 1 in axes)


def _pooled(size: int, pooled: int, block: int) -> int:
    return -(-size // block) if pooled else size


def _encode_fused(
    x: torch.Tensor, block: int, bits: int, group_size: int, low_dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor] | None:
    """The fused encoder's payload, or None where it declines (the caller's path)."""
    view = _fused_view(x.shape)
    low_ok = low_dtype in (torch.float32, torch.bfloat16)
    if view is None or not low_ok or group_size > _FUSED_MAX_GROUP or x.numel() == 0:
        return None
    planes, h, w, ph, pw = view
    xf = x.to(torch.float32).contiguous()  # .to alone keeps a transposed view's strides
    lib, threads = cpu_library(), cpu_threads()
    axes = pool_axes(x.ndim)
    low_shape = [_pooled(s, i in axes, block) for i, s in enumerate(x.shape)]
    low = torch.empty(low_shape, dtype=torch.float32)
    bf16 = int(low_dtype == torch.bfloat16)
    low16 = torch.empty(low_shape, dtype=torch.bfloat16) if bf16 else low
    args = (planes, h, w, block, ph, pw)
    out16 = low16.data_ptr() if bf16 else None
    if lib.acgc_division_low(xf.data_ptr(), *args, bf16, low.data_ptr(), out16, threads):
        return None
    n = xf.numel()
    groups = -(-n // group_size)
    codes = torch.empty(groups * group_size * bits // 8, dtype=torch.uint8)
    lo, scale = torch.empty(groups, dtype=torch.float32), torch.empty(groups, dtype=torch.float32)
    zbits, stats = torch.empty((n + 7) // 8, dtype=torch.uint8), torch.empty(2, dtype=torch.float32)
    if lib.acgc_division_residual(
        xf.data_ptr(), *args, low.data_ptr(), bits, group_size, hash_key(seed), lo.data_ptr(),
        scale.data_ptr(), codes.data_ptr(), zbits.data_ptr(), stats.data_ptr(), threads,
    ):  # fmt: skip
        return None
    x_min, min_pos = stats.tolist()
    payload = {
        "low": low16,
        "codes": codes,
        "lo": lo,
        "scale": scale,
        "res_exc_idx": cpu_empty(torch.int64),
        "res_exc_val": cpu_empty(torch.float32),
        "exc_idx": cpu_empty(torch.int64),
        "exc_val": cpu_empty(x.dtype),
    }
    if x_min == 0 and min_pos < math.inf:  # >= 0, zeros and a value > 0: the zero pattern
        payload["zero_mask"] = zbits
        payload["min_pos"] = stats[1:]
    elif x_min > 0:  # positive: decodes stay positive (reference.py's format)
        payload["min_pos"] = stats[:1]
    return payload


def _decode_fused(
    payload: dict[str, torch.Tensor],
    shape: torch.Size,
    dtype: torch.dtype,
    block: int,
    bits: int,
    group_size: int,
) -> torch.Tensor | None:
    """The fused decoder's tensor, or None where it declines (the caller's path)."""
    view = _fused_view(shape)
    lo, scale, codes = payload["lo"], payload["scale"], payload["codes"]
    n = shape.numel()
    groups = lo.numel()
    if (
        view is None
        or n == 0
        or group_size > _FUSED_MAX_GROUP
        or payload["res_exc_idx"].numel()
        or codes.numel() != groups * group_size * bits // 8
        or not (groups - 1) * group_size < n <= groups * group_size
    ):
        return None
    planes, h, w, ph, pw = view
    low = payload["low"].float().contiguous()
    if low.numel() != planes * _pooled(h, ph, block) * _pooled(w, pw, block):
        return None
    if lo.dtype != torch.float32 or scale.dtype != torch.float32:
        return None
    lo, scale = lo.contiguous(), scale.contiguous()
    zmask = payload.get("zero_mask")
    zmask = None if zmask is None else zmask.contiguous()
    min_pos = _min_pos(payload)
    out = torch.empty(n, dtype=torch.float32)
    if cpu_library().acgc_division_decode(
        codes.contiguous().data_ptr(), planes, h, w, block, ph, pw, low.data_ptr(), bits,
        group_size, lo.data_ptr(), scale.data_ptr(), torch.finfo(dtype).max,
        None if zmask is None else zmask.data_ptr(), min_pos, out.data_ptr(), cpu_threads(),
    ):  # fmt: skip
        return None  # the residual's decode needs float64 arithmetic: the caller's path
    flat = out if dtype == torch.float32 else out.to(dtype)
    return restore_exceptions(flat, payload["exc_idx"], payload["exc_val"]).view(shape)


def division_encode_cpu(
    x: torch.Tensor,
    block: int,
    residual_bits: int,
    group_size: int,
    low_dtype: torch.dtype,
    seed: int,
) -> dict[str, torch.Tensor]:
    """Encode a non-empty CPU floating tensor (payload of ``division_encode_ref``)."""
    fused = _encode_fused(x, block, residual_bits, group_size, low_dtype, seed)
    if fused is not None:
        return fused
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
    shape = torch.Size(shape)
    fused = _decode_fused(payload, shape, dtype, block, residual_bits, group_size)
    if fused is not None:
        return fused
    args = (payload, shape, dtype, block, residual_bits, group_size)
    return division_decode_with(CPU_KERNELS, *args)
