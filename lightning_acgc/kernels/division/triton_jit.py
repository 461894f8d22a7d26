"""The ``@triton.jit`` kernels of the ``division`` codec (block pooling and the
per-tile residual/reconstruction); the launchers, checks and the exactness notes are in
:mod:`lightning_acgc.kernels.division.triton`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_acgc.kernels.common.triton_utils import (
    store_narrow,
)

__all__: list[str] = []


@triton.jit
def _pool_kernel(
    src_ptr,  # *fp32|fp16|bf16 (outer, L, inner), contiguous
    dst_ptr,  # *fp32 (outer, Lo, inner) tile averages (out)
    n_rows,  # outer * Lo
    L,  # length of the pooled axis
    Lo,  # cdiv(L, blk)
    inner,  # elements after the pooled axis
    blk,  # tile length
    BR: tl.constexpr,  # output rows (outer * Lo) per program
    BI: tl.constexpr,  # inner columns per program
    IDX64: tl.constexpr,  # indices need 64 bits
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    if IDX64:
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    ok = (rows < n_rows)[:, None] & (cols < inner)[None, :]
    o = rows // Lo
    start = (rows % Lo) * blk
    count = tl.minimum(L - start, blk)  # a partial tile averages its real elements
    base = (o * L + start)[:, None] * inner + cols[None, :]
    acc = tl.zeros((BR, BI), dtype=tl.float32)  # 0 + x_0 + ...: torch's order and -0.0
    for k in range(0, blk):
        take = ok & (k < count)[:, None]
        v = tl.load(src_ptr + base + k * inner, mask=take, other=0.0).to(tl.float32)
        acc = tl.where(take, acc + v, acc)
    avg = tl.div_rn(acc, tl.maximum(count, 1).to(tl.float32)[:, None])
    tl.store(dst_ptr + rows[:, None] * inner + cols[None, :], avg, mask=ok)


@triton.jit
def _tile_kernel(
    a_ptr,  # *fp32|fp16|bf16 (n_rows, W): x (encode) or the decoded residual (decode)
    low_ptr,  # *fp32|fp16|bf16 (O, A2, B2, W2) tile averages
    out_ptr,  # (n_rows, W): fp32 residual (encode) or the decoded tensor (decode) (out)
    zbits_ptr,  # *u8 packed zero mask (read if HAS_ZERO)
    min_pos_ptr,  # *fp32 [1] smallest positive value, the decode's floor (read if HAS_MIN)
    n_rows,  # O * A * B
    W,  # last axis
    A,  # first pooled middle axis (1 if none)
    B,  # second pooled middle axis (1 if none)
    A2,  # cdiv(A, blk)
    B2,  # cdiv(B, blk)
    W2,  # cdiv(W, blk) if LAST_POOLED else W
    blk,  # tile length
    fmax,  # largest finite value of the output dtype (decode clamp)
    BR: tl.constexpr,  # rows per program
    BC: tl.constexpr,  # columns per program
    LAST_POOLED: tl.constexpr,  # the last axis is pooled
    DECODE: tl.constexpr,  # False: a - up(low); True: clamp(a + up(low)), zero mask, cast
    HAS_ZERO: tl.constexpr,  # a zero mask is present
    HAS_MIN: tl.constexpr,  # min_pos is present (with a zero mask, or a positive tensor's)
    OUT_KIND: tl.constexpr,  # decode output: 0 fp32, 1 fp16, 2 bf16 bits as int16
    IDX64: tl.constexpr,  # indices need 64 bits
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    if IDX64:
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    ok = (rows < n_rows)[:, None] & (cols < W)[None, :]
    b = rows % B
    a = (rows // B) % A
    o = rows // (A * B)
    low_row = (o * A2 + a // blk) * B2 + b // blk
    low_col = cols // blk if LAST_POOLED else cols
    low = tl.load(low_ptr + low_row[:, None] * W2 + low_col[None, :], mask=ok, other=0.0)
    low = low.to(tl.float32)
    idx = rows[:, None] * W + cols[None, :]
    v = tl.load(a_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    if DECODE:
        v = tl.minimum(tl.maximum(v + low, -fmax), fmax)
        if HAS_MIN:
            v = tl.maximum(v, tl.load(min_pos_ptr))
        if HAS_ZERO:
            byte = tl.load(zbits_ptr + (idx >> 3), mask=ok, other=0).to(tl.int32)
            v = tl.where(((byte >> (idx & 7).to(tl.int32)) & 1) != 0, 0.0, v)
        tl.store(out_ptr + idx, store_narrow(v, OUT_KIND), mask=ok)
    else:
        tl.store(out_ptr + idx, v - low, mask=ok)
