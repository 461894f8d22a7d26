"""Triton kernels of the per-channel normalization: three launches in place of the torch
reference's four passes over the tensor and some twenty small ops, each a launch and host
time on a GPU. Equal to :func:`lightning_acgc.kernels.channels.reference.normalize_channels`
(up to the sign of zeros): min and max are exact, halves and the reciprocal are rounded
on their own (``mul_rn``, ``div_rn``: no FMA contraction), and ``(x − m)·inv`` is one
subtraction and one product, as torch computes it.

1. ``_row_stats_kernel``: per row (n, c) of ``plane`` values, its min, max and whether a
   value is NaN or ±inf.
2. ``_channel_params_kernel``: per channel, the rows' min and max over n, then ``m``, ``s``
   and ``inv = 1/s`` (0 where ``s = 0``), with the reference's passing rule.
3. ``_normalize_kernel``: ``y = (x − m_c)·inv_c`` in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from lightning_acgc.kernels.channels.reference import TINY
from lightning_acgc.kernels.common.triton_utils import (
    LAUNCH_OPTIONS,
    check_contiguous,
    check_device,
    check_dtype,
    eager_or_op,
    interpreting,
    mul_rn,
    next_power_of_2,
)

__all__ = ["normalize_channels_triton"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_ROW_BLOCK_MAX = 2048  # values of one row per step of a program
_CHANNELS_PER_PROGRAM = 128
_ELEMS_PER_PROGRAM = 2048


@triton.jit
def _load_f32(ptr, offs, ok, BF16: tl.constexpr):
    """float32 values at ``ptr + offs`` (0 where not ``ok``). bfloat16 arrives as its
    int16 bits and is widened by a shift: exact for subnormals too (the interpreter's
    bfloat16 cast flushes them)."""
    if BF16:
        bits = tl.load(ptr + offs, mask=ok, other=0).to(tl.int32) & 0xFFFF
        out = (bits << 16).to(tl.float32, bitcast=True)
    else:
        out = tl.load(ptr + offs, mask=ok, other=0.0).to(tl.float32)
    return out


@triton.jit
def _row_stats_kernel(
    x_ptr,  # *fp32|fp16|bf16 [rows * plane], contiguous
    lo_ptr,  # *fp32 [rows] (out)
    hi_ptr,  # *fp32 [rows] (out)
    bad_ptr,  # *u8 [rows] 1 where the row holds NaN or ±inf (out)
    plane,  # values per row
    BLOCK: tl.constexpr,  # values per step, a power of two
    IDX64: tl.constexpr,  # element indices need 64 bits
    BF16: tl.constexpr,  # x holds bfloat16 bits (an int16 view)
):
    row = tl.program_id(0)
    if IDX64:
        row = row.to(tl.int64)
    base = row * plane
    lo = tl.full([BLOCK], float("inf"), tl.float32)
    hi = tl.full([BLOCK], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(0, plane, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < plane
        v = _load_f32(x_ptr, base + offs, ok, BF16)
        bad = bad | (ok & ~(tl.abs(v) <= _FP32_MAX)).to(tl.int32)
        lo = tl.where(ok & (v < lo), v, lo)
        hi = tl.where(ok & (v > hi), v, hi)
    tl.store(lo_ptr + row, tl.min(lo, axis=0))
    tl.store(hi_ptr + row, tl.max(hi, axis=0))
    tl.store(bad_ptr + row, tl.max(bad, axis=0).to(tl.uint8))


@triton.jit
def _channel_params_kernel(
    lo_ptr,  # *fp32 [n, c] the rows' min
    hi_ptr,  # *fp32 [n, c] the rows' max
    bad_ptr,  # *u8 [n, c] the rows' NaN/inf flags
    m_ptr,  # *fp32 [c] midpoints (out)
    s_ptr,  # *fp32 [c] half ranges (out)
    inv_ptr,  # *fp32 [c] 1 / s, 0 where s = 0 (out)
    n,  # rows per channel (the batch)
    c,  # channels
    tiny,  # half ranges in (0, tiny) are passed
    BLOCK_C: tl.constexpr,  # channels per program
    INTERPRET: tl.constexpr,  # running on the CPU interpreter
):
    ch = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = ch < c
    lo = tl.full([BLOCK_C], float("inf"), tl.float32)
    hi = tl.full([BLOCK_C], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK_C], tl.int32)
    for i in range(0, n):
        row_lo = tl.load(lo_ptr + i * c + ch, mask=ok, other=float("inf"))
        row_hi = tl.load(hi_ptr + i * c + ch, mask=ok, other=float("-inf"))
        bad = bad | tl.load(bad_ptr + i * c + ch, mask=ok, other=0).to(tl.int32)
        lo = tl.where(row_lo < lo, row_lo, lo)
        hi = tl.where(row_hi > hi, row_hi, hi)
    lo = tl.where(bad != 0, 0.0, lo)  # passed below; keeps the arithmetic finite
    hi = tl.where(bad != 0, 0.0, hi)
    one_half = tl.full([BLOCK_C], 0.5, tl.float32)
    half_lo = mul_rn(lo, one_half, INTERPRET)  # x / 2 and x · 0.5 round alike (subnormals)
    half_hi = mul_rn(hi, one_half, INTERPRET)
    mid = half_lo + half_hi
    half = half_hi - half_lo
    passed = (bad != 0) | ((half > 0.0) & (half < tiny))
    mid = tl.where(passed, 0.0, mid)
    half = tl.where(passed, 1.0, half)
    pos = half > 0.0
    one = tl.full([BLOCK_C], 1.0, tl.float32)
    inv = tl.where(pos, tl.div_rn(one, tl.where(pos, half, one)), 0.0)
    tl.store(m_ptr + ch, mid, mask=ok)
    tl.store(s_ptr + ch, half, mask=ok)
    tl.store(inv_ptr + ch, inv, mask=ok)


@triton.jit
def _normalize_kernel(
    x_ptr,  # *fp32|fp16|bf16 [numel], contiguous
    m_ptr,  # *fp32 [c]
    inv_ptr,  # *fp32 [c]
    y_ptr,  # *fp32 [numel] (out)
    numel,
    plane,  # values per (n, c) row
    c,  # channels
    BLOCK: tl.constexpr,  # elements per program, a power of two
    IDX64: tl.constexpr,  # element indices need 64 bits
    BF16: tl.constexpr,  # x holds bfloat16 bits (an int16 view)
    INTERPRET: tl.constexpr,  # running on the CPU interpreter
):
    pid = tl.program_id(0)
    if IDX64:
        pid = pid.to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    ok = idx < numel
    ch = (idx // plane) % c
    x = _load_f32(x_ptr, idx, ok, BF16)
    mid = tl.load(m_ptr + ch, mask=ok, other=0.0)
    inv = tl.load(inv_ptr + ch, mask=ok, other=0.0)
    tl.store(y_ptr + idx, mul_rn(x - mid, inv, INTERPRET), mask=ok)


@eager_or_op("lightning_acgc::channel_normalize_core")
def _normalize_core(
    x: torch.Tensor, n: int, c: int, plane: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three launches: ``(y, m, s)`` flat (the caller checked the arguments)."""
    rows = n * c
    dev = x.device
    lo = torch.empty(rows, dtype=torch.float32, device=dev)
    hi = torch.empty_like(lo)
    bad = torch.empty(rows, dtype=torch.uint8, device=dev)
    block = min(next_power_of_2(plane), _ROW_BLOCK_MAX)
    idx64 = x.numel() + _ELEMS_PER_PROGRAM >= 2**31
    bf16 = x.dtype == torch.bfloat16
    x = x.view(torch.int16) if bf16 else x
    wrap_triton(_row_stats_kernel)[(rows,)](
        x, lo, hi, bad, plane, BLOCK=block, IDX64=idx64, BF16=bf16, **LAUNCH_OPTIONS
    )
    m = torch.empty(c, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    inv = torch.empty_like(m)
    wrap_triton(_channel_params_kernel)[(triton.cdiv(c, _CHANNELS_PER_PROGRAM),)](
        lo, hi, bad, m, s, inv, n, c, TINY,
        BLOCK_C=_CHANNELS_PER_PROGRAM, INTERPRET=interpreting(), **LAUNCH_OPTIONS,
    )  # fmt: skip
    y = torch.empty(x.numel(), dtype=torch.float32, device=dev)
    wrap_triton(_normalize_kernel)[(triton.cdiv(x.numel(), _ELEMS_PER_PROGRAM),)](
        x, m, inv, y, x.numel(), plane, c,
        BLOCK=_ELEMS_PER_PROGRAM, IDX64=idx64, BF16=bf16, INTERPRET=interpreting(),
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return y, m, s


def normalize_channels_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, m, s)`` as :func:`~lightning_acgc.kernels.channels.reference.normalize_channels`
    computes them, for a non-empty contiguous float32/float16/bfloat16 tensor of at least
    two dimensions on a CUDA device (or any device under ``TRITON_INTERPRET=1``).

    Raises:
        RuntimeError: Triton cannot run on ``x``'s device.
        TypeError: an unsupported dtype.
        ValueError: fewer than two dimensions, empty, or not contiguous.
    """
    check_device(x, "x")
    check_dtype(x, "x", _DTYPES)
    check_contiguous(x, "x")
    if x.dim() < 2 or x.numel() == 0:
        raise ValueError(f"x must be non-empty with at least two dimensions, got {tuple(x.shape)}")
    n, c = x.shape[0], x.shape[1]
    y, m, s = _normalize_core(x.detach(), n, c, x.numel() // (n * c))
    shape = (1, c) + (1,) * (x.dim() - 2)
    return y.view(x.shape), m.view(shape), s.view(shape)
