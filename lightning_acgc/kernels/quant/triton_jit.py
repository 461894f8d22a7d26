"""The ``@triton.jit`` kernels of the ``quant`` codec (fused encode and decode); the
launchers, checks and the exactness notes are in :mod:`lightning_acgc.kernels.quant.triton`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_acgc.kernels.common.triton_utils import (
    mul_rn,
    store_narrow,
    uniform_rows,
)

__all__: list[str] = []

# Values of the per-group status the encode kernel writes (the launcher reads the max).
_OK, _FLOAT64, _NONFINITE = 0, 1, 2


@triton.jit(do_not_specialize=["seed"])
def _quant_encode_kernel(
    x_ptr,  # *fp32|fp16|bf16 [numel], contiguous input
    noise_ptr,  # *fp32 [n_groups, GROUP] injected U[0,1) noise; read only if USE_NOISE
    codes_ptr,  # *u8 [n_groups * GROUP * BITS // 8] bit stream of the codes (out)
    lo_ptr,  # *fp32 [n_groups] value of code 0, of code 1 in zero-kept groups (out)
    scale_ptr,  # *fp32 [n_groups] step between codes, sign bit set if zero-kept (out)
    status_ptr,  # *i32 [1], zeroed: raised to the worst group's status (0 ok, 1 needs
    #   float64, see below, 2 NaN/inf inside), one atomic per program (out)
    numel,  # elements of x; the tail group is padded with x[numel - 1]
    n_groups,  # cdiv(numel, GROUP)
    seed,  # Philox seed (non-negative, < 2**63)
    GROUP: tl.constexpr,  # group size, a multiple of 8
    GROUP_P2: tl.constexpr,  # next power of two >= GROUP (block width)
    BITS: tl.constexpr,  # 1 to 8
    GPP: tl.constexpr,  # groups per program (block height), a power of two
    USE_NOISE: tl.constexpr,  # read noise_ptr instead of drawing Philox noise
    IDX64: tl.constexpr,  # element indices need 64 bits
    INTERPRET: tl.constexpr,  # running on the CPU interpreter
):
    pid = tl.program_id(0)
    rows = pid * GPP + tl.arange(0, GPP)
    if IDX64:
        rows = rows.to(tl.int64)
    cols = tl.arange(0, GROUP_P2)
    row_ok = rows < n_groups
    ok = row_ok[:, None] & (cols < GROUP)[None, :]
    idx = rows[:, None] * GROUP + cols[None, :]
    # Padding past numel repeats the last element, as the reference's group_view does
    # (a select after the load: clamping the address would hide its contiguity from the
    # compiler, which then loads element by element instead of in vectors).
    inside = idx < numel
    x = tl.load(x_ptr + idx, mask=ok & inside, other=0.0).to(tl.float32)
    x = tl.where(inside, x, tl.load(x_ptr + numel - 1).to(tl.float32))

    # NaN/inf: flag the group (the launcher redoes it) and compute on zeros meanwhile.
    bad = (x != x) | (tl.abs(x) == float("inf"))
    x = tl.where(bad, 0.0, x)
    lo = tl.min(tl.where(ok, x, float("inf")), axis=1)
    hi = tl.max(tl.where(ok, x, float("-inf")), axis=1)
    lo = tl.where(row_ok, lo, 0.0)
    hi = tl.where(row_ok, hi, 0.0)

    LEVELS: tl.constexpr = (1 << BITS) - 1
    if BITS > 1:
        # Zero-kept group: min exactly 0 and max > 0. Code 0 is an exact zero, codes
        # 1..LEVELS cover [smallest positive, max].
        zk = (lo == 0.0) & (hi > 0.0)
        min_pos = tl.min(tl.where(ok & (x > 0.0), x, float("inf")), axis=1)
        lo = tl.where(zk, min_pos, lo)
        top = tl.where(zk, LEVELS - 1.0, LEVELS * 1.0)
    else:
        zk = lo != lo  # all False: 1-bit groups never keep zeros
        top = tl.full(lo.shape, LEVELS * 1.0, tl.float32)
    rng = hi - lo
    step = tl.div_rn(rng, top)
    pos = step > 0.0
    inv = tl.div_rn(tl.full(step.shape, 1.0, tl.float32), tl.where(pos, step, 1.0))
    # The reference redoes the whole tensor in float64 when a range overflows float32 or
    # a (subnormal) step has no finite inverse; flag it, keep this pass finite.
    wide = (rng == float("inf")) | (inv == float("inf"))
    inv = tl.where(pos & ~wide, inv, 0.0)
    base = tl.where(wide, 0.0, lo)
    t = mul_rn(x - base[:, None], inv[:, None], INTERPRET)  # then + u: no FMA, as torch

    if USE_NOISE:
        u = tl.load(noise_ptr + idx, mask=ok, other=0.0)
    else:
        u = uniform_rows(seed, rows, GROUP, GROUP_P2)
    q = tl.floor(t + u)
    q = tl.minimum(tl.maximum(q, 0.0), top[:, None])
    qi = q.to(tl.int32)
    if BITS > 1:
        qi += ((x != 0.0) & zk[:, None]).to(tl.int32)

    if BITS == 8:
        tl.store(codes_ptr + idx, qi.to(tl.uint8), mask=ok)
    elif 8 % BITS != 0:
        # 3, 5, 6, 7 bits: 8 codes -> one word, code k at bit BITS * k -> its BITS low bytes
        NW: tl.constexpr = GROUP // 8
        NW_P2: tl.constexpr = GROUP_P2 // 8
        q3 = tl.reshape(qi.to(tl.int64), (GPP, NW_P2, 8))
        wshift = (tl.arange(0, 8) * BITS).to(tl.int64)
        word = tl.sum(q3 << wshift[None, None, :], axis=2)  # disjoint bits: sum == or
        wcols = tl.arange(0, NW_P2)
        wok = row_ok[:, None] & (wcols < NW)[None, :]
        wbase = rows[:, None] * (NW * BITS) + wcols[None, :] * BITS
        for j in tl.static_range(BITS):
            tl.store(codes_ptr + wbase + j, ((word >> (8 * j)) & 255).to(tl.uint8), mask=wok)
    else:
        PER: tl.constexpr = 8 // BITS  # codes per byte; code k at bit BITS * k
        NB: tl.constexpr = GROUP // PER  # bytes per group
        NB_P2: tl.constexpr = GROUP_P2 // PER
        q3 = tl.reshape(qi, (GPP, NB_P2, PER))
        shifts = tl.arange(0, PER) * BITS
        packed = tl.sum(q3 << shifts[None, None, :], axis=2)  # disjoint bits: sum == or
        bcols = tl.arange(0, NB_P2)
        bidx = rows[:, None] * NB + bcols[None, :]
        bok = row_ok[:, None] & (bcols < NB)[None, :]
        tl.store(codes_ptr + bidx, packed.to(tl.uint8), mask=bok)

    tl.store(lo_ptr + rows, lo, mask=row_ok)
    # The sign bit marks zero-kept groups, also where the step is 0 (one distinct
    # positive among zeros): set as a bit, since the GPU compiler may fold a negation
    # of +0.0 in a select into +0.0 (seen on sm_90 with Triton 3.6).
    sign = zk.to(tl.int32) << 31
    scale = (step.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    n_bad = tl.sum((bad & ok).to(tl.int32), axis=1)
    status = tl.where(n_bad > 0, 2, tl.where(wide & row_ok, 1, 0))
    tl.atomic_max(status_ptr, tl.max(status, axis=0))


@triton.jit
def _quant_decode_kernel(
    codes_ptr,  # *u8 [n_groups * GROUP * BITS // 8] packed codes
    lo_ptr,  # *fp32 [n_groups]
    scale_ptr,  # *fp32 [n_groups], sign bit marks zero-kept groups
    f64_ptr,  # *i32 [1] nonzero: compute in float64 (some lo + levels * step overflows)
    out_ptr,  # *fp32|fp16|int16 (bfloat16 bits)|fp64 [numel] decoded values (out)
    numel,  # values to write
    n_groups,  # groups in the payload
    GROUP: tl.constexpr,  # group size, a multiple of 8
    GROUP_P2: tl.constexpr,  # next power of two >= GROUP
    BITS: tl.constexpr,  # 1 to 8
    GPP: tl.constexpr,  # groups per program, a power of two
    IDX64: tl.constexpr,  # element indices need 64 bits
    OUT_KIND: tl.constexpr,  # out_ptr holds 0 float32, 1 float16, 2 bfloat16 bits, 3 float64
):
    pid = tl.program_id(0)
    rows = pid * GPP + tl.arange(0, GPP)
    if IDX64:
        rows = rows.to(tl.int64)
    row_ok = rows < n_groups
    if 8 % BITS != 0:
        # 3, 5, 6, 7 bits: words of 8 codes in BITS bytes, code k at bit BITS * k
        NW: tl.constexpr = GROUP // 8
        NW_P2: tl.constexpr = GROUP_P2 // 8
        wcols = tl.arange(0, NW_P2)
        wok = row_ok[:, None] & (wcols < NW)[None, :]
        wbase = rows[:, None] * (NW * BITS) + wcols[None, :] * BITS
        word = tl.zeros((GPP, NW_P2), dtype=tl.int64)
        for j in tl.static_range(BITS):
            b = tl.load(codes_ptr + wbase + j, mask=wok, other=0).to(tl.int64)
            word = word | (b << (8 * j))
        k = tl.arange(0, 8)
        q = ((word[:, :, None] >> (k * BITS).to(tl.int64)[None, None, :]) & ((1 << BITS) - 1)).to(
            tl.int32
        )  # [GPP, NW_P2, 8]
        idx = (rows[:, None] * GROUP + wcols[None, :] * 8)[:, :, None] + k[None, None, :]
        ok = wok[:, :, None] & (idx < numel)
    else:
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = GROUP // PER
        NB_P2: tl.constexpr = GROUP_P2 // PER
        bcols = tl.arange(0, NB_P2)
        bidx = rows[:, None] * NB + bcols[None, :]
        bok = row_ok[:, None] & (bcols < NB)[None, :]
        byte = tl.load(codes_ptr + bidx, mask=bok, other=0).to(tl.int32)
        k = tl.arange(0, PER)
        q = (byte[:, :, None] >> (k * BITS)[None, None, :]) & ((1 << BITS) - 1)  # [GPP, NB_P2, PER]
        idx = bidx[:, :, None] * PER + k[None, None, :]  # == row * GROUP + col
        ok = bok[:, :, None] & (idx < numel)

    lo = tl.load(lo_ptr + rows, mask=row_ok, other=0.0)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    zk = scale.to(tl.int32, bitcast=True) < 0  # signbit, also for -0.0
    step = tl.abs(scale)
    zk3 = zk[:, None, None]
    qf = q - zk3.to(tl.int32)  # zero-kept: code c >= 1 is lo + (c - 1) * step
    exact_zero = zk3 & (q == 0)
    # (each branch stores its own variable: compiled Triton merges same-named variables
    # of the two branches, which must then have one type)
    if tl.load(f64_ptr) != 0:
        w = tl.fma(
            qf.to(tl.float64), step.to(tl.float64)[:, None, None], lo.to(tl.float64)[:, None, None]
        )
        w = tl.where(exact_zero, 0.0, w)
        if OUT_KIND != 3:
            # values were finite: one rounded a hair past float32's largest stays finite
            big = 3.4028234663852886e38
            w = tl.where(w > big, big, tl.where(w < -big, -big, w))  # NaN stays NaN
            w = w.to(tl.float32)  # torch narrows float64 to half types through float32
        tl.store(out_ptr + idx, store_narrow(w, OUT_KIND), mask=ok)
    else:
        v = tl.fma(qf.to(tl.float32), step[:, None, None], lo[:, None, None])
        v = tl.where(exact_zero, 0.0, v)
        tl.store(out_ptr + idx, store_narrow(v, OUT_KIND), mask=ok)


@triton.jit
def _quant_wide_kernel(
    lo_ptr,  # *fp32 [n_groups]
    scale_ptr,  # *fp32 [n_groups], sign bit marks zero-kept groups
    flag_ptr,  # *i32 [1], zeroed: set to 1 if some lo + LEVELS * |step| overflows (out)
    n_groups,
    LEVELS: tl.constexpr,  # 2**bits - 1
    BLOCK: tl.constexpr,  # groups per program, a power of two
    INTERPRET: tl.constexpr,  # running on the CPU interpreter
):
    """The decode's float64 switch, as the reference decides it: whether any group's top
    value ``lo + LEVELS * |step|`` (a float32 product, then a float32 sum: never one
    FMA) is not finite."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_groups
    lo = tl.load(lo_ptr + offs, mask=ok, other=0.0)
    step = tl.abs(tl.load(scale_ptr + offs, mask=ok, other=0.0))
    top = lo + mul_rn(step, tl.full(step.shape, LEVELS * 1.0, tl.float32), INTERPRET)
    bad = ok & ((top != top) | (tl.abs(top) == float("inf")))
    tl.atomic_max(flag_ptr, tl.max(bad.to(tl.int32), axis=0))
