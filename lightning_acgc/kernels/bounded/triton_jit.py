"""The ``@triton.jit`` kernels of the ``bounded`` codec (group statistics, encode,
decode); the launchers and the work split are in :mod:`lightning_acgc.kernels.bounded.triton`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_acgc.kernels.common.triton_utils import (
    mul_rn,
    store_narrow,
)

__all__: list[str] = []


@triton.jit
def _stats_kernel(
    x_ptr,  # *fp32|fp16|bf16 [numel] input, contiguous
    lo_ptr,  # *fp32 [G] min of the finite values (out)
    hi_ptr,  # *fp32 [G] max of the finite values (out)
    min_pos_ptr,  # *fp32 [G] smallest positive value, inf if none (out)
    has_zero_ptr,  # *u8 [G] some value is exactly +-0 (out)
    n_bad_ptr,  # *i32 [G] NaN/inf count (out)
    numel,  # elements of x; the tail group repeats x[numel - 1]
    n_groups,  # G
    GROUP: tl.constexpr,  # group size, a multiple of 8
    GROUP_P2: tl.constexpr,  # next power of two >= GROUP
    GPP: tl.constexpr,  # groups per program
    IDX64: tl.constexpr,  # indices need 64 bits
):
    rows = tl.program_id(0) * GPP + tl.arange(0, GPP)
    if IDX64:
        rows = rows.to(tl.int64)
    cols = tl.arange(0, GROUP_P2)
    row_ok = rows < n_groups
    ok = row_ok[:, None] & (cols < GROUP)[None, :]
    idx = rows[:, None] * GROUP + cols[None, :]
    x = tl.load(x_ptr + tl.minimum(idx, numel - 1), mask=ok, other=0.0).to(tl.float32)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    fin = ok & ~bad
    tl.store(lo_ptr + rows, tl.min(tl.where(fin, x, float("inf")), axis=1), mask=row_ok)
    tl.store(hi_ptr + rows, tl.max(tl.where(fin, x, float("-inf")), axis=1), mask=row_ok)
    min_pos = tl.min(tl.where(fin & (x > 0.0), x, float("inf")), axis=1)
    tl.store(min_pos_ptr + rows, min_pos, mask=row_ok)
    zero = tl.max((fin & (x == 0.0)).to(tl.int32), axis=1)
    tl.store(has_zero_ptr + rows, zero.to(tl.uint8), mask=row_ok)
    tl.store(n_bad_ptr + rows, tl.sum((ok & bad).to(tl.int32), axis=1), mask=row_ok)


@triton.jit
def _encode_kernel(
    x_ptr,  # *fp32|fp16|bf16 [numel] input, contiguous
    rows_ptr,  # *i64 [n_rows] groups to process (read if FLAGS)
    lo_ptr,  # *fp32 [G] payload lo (code 0, code 1 if zero-kept; 0 for raw groups)
    step_ptr,  # *fp32 [G] payload step (negative if zero-kept, 0 if constant or raw)
    fill_ptr,  # *fp32 [G] value NaN/inf are replaced with (the group's finite min, or 0)
    width_ptr,  # *u8 [G] code width, 0 constant, 255 raw
    off_ptr,  # *i64 [G] first byte of the group's codes
    raw_rank_ptr,  # *i64 [G] index of the group among the raw ones
    codes_ptr,  # *u8 packed codes (out, unless FLAGS)
    raw_ptr,  # *fp32|fp16|int16 (bf16 bits) [n_raw * GROUP] raw values (out, unless FLAGS)
    n_viol_ptr,  # *i32 [G] elements missing the bound (out, unless FLAGS)
    flags_ptr,  # *u8 [n_rows, GROUP] 1 where an exception (out, if FLAGS)
    numel,  # elements of x
    n_rows,  # groups to process: G, or the length of rows_ptr if FLAGS
    eb32,  # the bound rounded down to float32; a decoded value must be strictly closer
    fmax,  # largest finite value of the dtype
    GROUP: tl.constexpr,  # group size, a multiple of 8
    GROUP_P2: tl.constexpr,  # next power of two >= GROUP
    GPP: tl.constexpr,  # groups per program
    OUT_KIND: tl.constexpr,  # dtype: 0 fp32, 1 fp16, 2 bf16
    FLAGS: tl.constexpr,  # write the per-element exception flags of the listed groups
    INTERPRET: tl.constexpr,  # running on the CPU interpreter
    IDX64: tl.constexpr,  # indices need 64 bits
):
    slot = tl.program_id(0) * GPP + tl.arange(0, GPP)
    slot_ok = slot < n_rows
    rows = tl.load(rows_ptr + slot, mask=slot_ok, other=0) if FLAGS else slot
    if IDX64:
        rows = rows.to(tl.int64)
    cols = tl.arange(0, GROUP_P2)
    ok = slot_ok[:, None] & (cols < GROUP)[None, :]
    idx = rows[:, None] * GROUP + cols[None, :]
    x = tl.load(x_ptr + tl.minimum(idx, numel - 1), mask=ok, other=0.0).to(tl.float32)
    bad = ((x != x) | (tl.abs(x) == float("inf"))) & ok
    fill = tl.load(fill_ptr + rows, mask=slot_ok, other=0.0)
    x = tl.where(bad, fill[:, None], x)

    width = tl.load(width_ptr + rows, mask=slot_ok, other=0).to(tl.int32)
    lo = tl.load(lo_ptr + rows, mask=slot_ok, other=0.0)
    step = tl.load(step_ptr + rows, mask=slot_ok, other=0.0)
    coded = (width >= 1) & (width <= 16)
    zk = step.to(tl.int32, bitcast=True) < 0  # signbit
    s = tl.abs(step)
    # Codes: round half to even of (x - lo) / step (|.| < 2^17 in coded groups, where the
    # 1.5 * 2^23 trick rounds exactly); zero-kept groups shift by one, zeros get code 0.
    t = tl.div_rn(x - lo[:, None], tl.where(coded, s, 1.0)[:, None])
    q = (t + 12582912.0) - 12582912.0
    q = tl.where(coded[:, None], q, 0.0)
    q = tl.where(zk[:, None], tl.where(x != 0.0, q + 1.0, 0.0), q)

    # The decoder's values, as in the reference's check.
    qz = q - zk.to(tl.float32)[:, None]
    v = mul_rn(qz, s[:, None], INTERPRET) + lo[:, None]
    v = tl.minimum(tl.maximum(v, -fmax), fmax)
    v = tl.where(qz >= 0.0, v, 0.0)
    v = _round_to(v, OUT_KIND)
    viol = coded[:, None] & ~(tl.abs(v - x) < eb32) & ok

    if FLAGS:
        flag = (viol | bad).to(tl.uint8)
        tl.store(flags_ptr + slot[:, None] * GROUP + cols[None, :], flag, mask=ok)
    else:
        tl.store(n_viol_ptr + rows, tl.sum(viol.to(tl.int32), axis=1), mask=slot_ok)
        # Raw groups: the (filled) values in the dtype.
        is_raw = width == 255
        rank = tl.load(raw_rank_ptr + rows, mask=slot_ok & is_raw, other=0)
        raw_at = rank[:, None] * GROUP + cols[None, :]
        tl.store(raw_ptr + raw_at, store_narrow(x, OUT_KIND), mask=ok & is_raw[:, None])
        # Codes: 8 codes of b bits form b bytes; build them as four 32-bit words.
        NBLK: tl.constexpr = GROUP_P2 // 8
        q3 = tl.reshape(q.to(tl.int32), (GPP, NBLK, 8))
        k = tl.arange(0, 8)
        first = width[:, None, None] * k[None, None, :]  # first bit of code k in its block
        w0 = _word(q3, first, width, 0)
        w1 = _word(q3, first, width, 32)
        w2 = _word(q3, first, width, 64)
        w3 = _word(q3, first, width, 96)
        blk = tl.arange(0, NBLK)
        base = tl.load(off_ptr + rows, mask=slot_ok & coded, other=0)
        at = base[:, None] + blk[None, :] * width[:, None]
        store_ok = (slot_ok & coded)[:, None] & (blk < GROUP // 8)[None, :]
        for m in tl.static_range(16):
            word = w0 if m < 4 else (w1 if m < 8 else (w2 if m < 12 else w3))
            byte = (word >> (8 * (m % 4))) & 0xFF
            tl.store(codes_ptr + at + m, byte.to(tl.uint8), mask=store_ok & (m < width)[:, None])


@triton.jit
def _word(q3, first, width, LOW: tl.constexpr):
    """Bits ``[LOW, LOW + 32)`` of each block's stream of 8 codes (code k at bit
    ``first[k]``); ``q3`` is ``[GPP, NBLK, 8]`` int32, codes below ``2^width``."""
    sh = first - LOW
    left = q3 << tl.minimum(tl.maximum(sh, 0), 31)
    right = q3 >> tl.minimum(tl.maximum(-sh, 0), 31)
    part = tl.where(sh >= 0, left, right)
    part = tl.where((sh < 32) & (sh > -width[:, None, None]), part, 0)
    return tl.sum(part, axis=2)  # disjoint bits: sum == or


@triton.jit
def _round_to(v, OUT_KIND: tl.constexpr):
    """float32 ``v`` rounded to the dtype of ``OUT_KIND`` (0 fp32, 1 fp16, 2 bf16) and
    back to float32."""
    if OUT_KIND == 0:
        out = v
    elif OUT_KIND == 1:
        out = v.to(tl.float16).to(tl.float32)
    else:
        out = (store_narrow(v, 2).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return out


@triton.jit
def _decode_kernel(
    codes_ptr,  # *u8 packed codes
    lo_ptr,  # *fp32 [G]
    step_ptr,  # *fp32 [G]
    width_ptr,  # *u8 [G]
    off_ptr,  # *i64 [G] first byte of the group's codes
    raw_rank_ptr,  # *i64 [G] index of the group among the raw ones
    raw_ptr,  # *fp32|fp16|int16 (bf16 bits) raw values
    out_ptr,  # *fp32|fp16|int16 (bf16 bits) [numel] decoded values (out)
    numel,  # values to write
    n_groups,  # G
    fmax,  # largest finite value of the dtype
    GROUP: tl.constexpr,  # group size, a multiple of 8
    GROUP_P2: tl.constexpr,  # next power of two >= GROUP
    GPP: tl.constexpr,  # groups per program
    OUT_KIND: tl.constexpr,  # dtype: 0 fp32, 1 fp16, 2 bf16
    INTERPRET: tl.constexpr,  # running on the CPU interpreter
    IDX64: tl.constexpr,  # indices need 64 bits
):
    rows = tl.program_id(0) * GPP + tl.arange(0, GPP)
    if IDX64:
        rows = rows.to(tl.int64)
    cols = tl.arange(0, GROUP_P2)
    row_ok = rows < n_groups
    idx = rows[:, None] * GROUP + cols[None, :]
    ok = row_ok[:, None] & (cols < GROUP)[None, :] & (idx < numel)
    width = tl.load(width_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    lo = tl.load(lo_ptr + rows, mask=row_ok, other=0.0)
    step = tl.load(step_ptr + rows, mask=row_ok, other=0.0)
    coded = (width >= 1) & (width <= 16)
    base = tl.load(off_ptr + rows, mask=row_ok & coded, other=0)
    # Value c of a group of width b: bits [b*c, b*c + b) of its stream, in <= 3 bytes.
    bit = width[:, None] * cols[None, :]
    at = base[:, None] + (bit >> 3)
    n_bytes = width * (GROUP // 8)
    take = ok & coded[:, None]
    word = tl.zeros((GPP, GROUP_P2), dtype=tl.int32)
    for j in tl.static_range(3):
        in_group = take & ((bit >> 3) + j < n_bytes[:, None])
        byte = tl.load(codes_ptr + at + j, mask=in_group, other=0).to(tl.int32)
        word = word | (byte << (8 * j))
    q = (word >> (bit & 7)) & ((1 << tl.minimum(width, 16)[:, None]) - 1)
    zk = step.to(tl.int32, bitcast=True) < 0
    qz = q.to(tl.float32) - zk.to(tl.float32)[:, None]
    v = mul_rn(qz, tl.abs(step)[:, None], INTERPRET) + lo[:, None]
    v = tl.minimum(tl.maximum(v, -fmax), fmax)
    v = tl.where(qz >= 0.0, v, 0.0)
    out = store_narrow(v, OUT_KIND)
    is_raw = width == 255
    rank = tl.load(raw_rank_ptr + rows, mask=row_ok & is_raw, other=0)
    raw = tl.load(raw_ptr + rank[:, None] * GROUP + cols[None, :], mask=ok & is_raw[:, None])
    out = tl.where(is_raw[:, None], raw, out)
    tl.store(out_ptr + idx, out, mask=ok)
