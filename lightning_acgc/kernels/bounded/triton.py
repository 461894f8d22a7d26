"""Triton kernels of the ``bounded`` (error-bounded) codec, same format as the torch
reference in :mod:`lightning_acgc.kernels.bounded.reference` (read its docstring for the format).

The codec is deterministic, so the payload and the decoded values are bit-identical to
the reference's. Work split:

1. ``_stats_kernel`` (one pass over ``x``): per group the finite min/max, the smallest
   positive value, whether it holds a zero and how many NaN/inf.
2. torch on the ``G`` per-group values: the bound, each group's kind, step, base and code
   width (the reference's :func:`~lightning_acgc.kernels.bounded.plan.group_plan`), the byte
   offsets of the variable-width groups (a cumsum) and the ranks of the raw groups.
3. ``_encode_kernel`` (second pass): codes rounded half to even, packed at each group's
   width into its byte range, raw groups copied, the decode check counted per group.
   Groups with violators or NaN/inf are run again with ``FLAGS`` to list the exceptions.

``_decode_kernel`` unpacks each value from its group's bit stream (up to three bytes),
dequantizes in float32 without FMA, clamps, casts, and copies raw groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from lightning_acgc.kernels.bounded.plan import (
    RAW_WIDTH,
    abs_bound,
    check_args,
    f32_down,
    group_plan,
)
from lightning_acgc.kernels.common.nonfinite import restore_exceptions
from lightning_acgc.kernels.common.triton_utils import (
    LAUNCH_OPTIONS,
    check_contiguous,
    check_device,
    check_dtype,
    interpreting,
    mul_rn,
    next_power_of_2,
    rows_per_program,
    store_narrow,
)

__all__ = ["bounded_decode_triton", "bounded_encode_triton"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def _layout(width: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Per group the first byte of its codes and its rank among the raw groups; the total
    code bytes and raw groups (one host sync)."""
    raw = width == RAW_WIDTH
    coded_width = width.to(torch.int64) * ~raw
    ends = torch.cumsum(coded_width, 0)
    raw_ends = torch.cumsum(raw.to(torch.int64), 0)
    totals = torch.stack([ends[-1], raw_ends[-1]]).tolist()
    offsets = (ends - coded_width) * (group_size // 8)
    return offsets, raw_ends - raw.to(torch.int64), totals[0] * (group_size // 8), totals[1]


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype the kernels write for ``dtype`` (bfloat16 as its int16 bits)."""
    return torch.int16 if dtype == torch.bfloat16 else dtype


@triton_op("lightning_acgc::bounded_stats_core", mutates_args=())
def _stats_core(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group ``(lo, hi, min_pos, has_zero, n_bad)`` of contiguous ``x``."""
    numel = x.numel()
    n_groups = triton.cdiv(numel, group_size)
    group_p2 = next_power_of_2(group_size)
    gpp = rows_per_program(group_p2, n_groups)
    dev = x.device
    lo = torch.empty(n_groups, dtype=torch.float32, device=dev)
    hi, min_pos = torch.empty_like(lo), torch.empty_like(lo)
    has_zero = torch.empty(n_groups, dtype=torch.uint8, device=dev)
    n_bad = torch.empty(n_groups, dtype=torch.int32, device=dev)
    wrap_triton(_stats_kernel)[(triton.cdiv(n_groups, gpp),)](
        x,
        lo,
        hi,
        min_pos,
        has_zero,
        n_bad,
        numel,
        n_groups,
        GROUP=group_size,
        GROUP_P2=group_p2,
        GPP=gpp,
        IDX64=(n_groups + gpp) * group_p2 >= 2**31,
        **LAUNCH_OPTIONS,
    )
    return lo, hi, min_pos, has_zero, n_bad


def _group_params(
    lo: torch.Tensor,
    hi: torch.Tensor,
    min_pos: torch.Tensor,
    has_zero: torch.Tensor,
    n_bad: torch.Tensor,
    error_bound: float,
    relative: bool,
    dtype: torch.dtype,
    group_size: int,
) -> tuple[torch.Tensor, ...]:
    """The per-group decisions (:func:`~lightning_acgc.kernels.bounded.plan.group_plan`, as
    the reference makes them) from the group statistics: ``(width, lo_p, step_p, fill,
    eb)``. NaN/inf count as the group's finite min, 0 in a group without finite values
    (the reference's ``fill_nonfinite_rows``)."""
    has_finite = n_bad < group_size
    lo = torch.where(has_finite, lo, 0.0)
    hi = torch.where(has_finite, hi, 0.0)
    any_bad = bool((n_bad > 0).any())
    eb = abs_bound(lo, hi, has_finite if any_bad else None, error_bound, relative)
    plan = group_plan(lo, hi, eb, dtype, has_zero=lambda: has_zero != 0, min_pos=lambda: min_pos)
    return plan.width, plan.lo, plan.step, lo, eb


def bounded_encode_triton(
    x: torch.Tensor, error_bound: float, group_size: int, relative: bool = False
) -> dict[str, torch.Tensor]:
    """Encode ``x`` in the format of
    :func:`~lightning_acgc.kernels.bounded.reference.bounded_encode_ref`, bit for bit.

    Args:
        x: non-empty contiguous float32/float16/bfloat16 tensor on a CUDA device (or any
            device under ``TRITON_INTERPRET=1``).
        error_bound: the absolute bound, or relative to the finite range if ``relative``.
        group_size: values per group, a positive multiple of 8.
        relative: ``error_bound`` is a fraction of ``max - min`` of the finite values.

    Returns:
        The payload dict (``width``, ``lo``, ``step``, ``codes``, ``raw``, ``exc_idx``,
        ``exc_val``, ``bound``).

    Raises:
        RuntimeError: Triton cannot run on ``x``'s device.
        TypeError: unsupported dtype.
        ValueError: empty or non-contiguous ``x``, bad ``group_size`` or bound.
    """
    check_device(x, "x")
    check_dtype(x, "x", _DTYPES)
    check_contiguous(x, "x")
    check_args(x.dtype, group_size)
    if not error_bound > 0 or error_bound == float("inf"):
        raise ValueError(f"error_bound={error_bound!r} must be a finite number > 0")
    numel = x.numel()
    if numel == 0:
        raise ValueError("x is empty; keep empty tensors raw")
    dtype, dev = x.dtype, x.device
    n_groups = triton.cdiv(numel, group_size)
    lo, hi, min_pos, has_zero, n_bad = _stats_core(x, group_size)
    width, lo_p, step_p, fill, eb = _group_params(
        lo, hi, min_pos, has_zero, n_bad, error_bound, relative, dtype, group_size
    )
    offsets, raw_rank, n_code_bytes, n_raw = _layout(width, group_size)
    codes = torch.zeros(n_code_bytes, dtype=torch.uint8, device=dev)
    raw = torch.empty(n_raw * group_size, dtype=dtype, device=dev)
    n_viol = torch.empty(n_groups, dtype=torch.int32, device=dev)
    eb32 = float(f32_down(eb))
    group_p2 = next_power_of_2(group_size)
    raw_bits = raw.view(_bits_dtype(dtype))
    fmax = torch.finfo(dtype).max

    def launch(rows: torch.Tensor | None, flags: torch.Tensor | None) -> None:
        """All groups (``rows`` None), or the listed ones writing their ``flags``."""
        n_rows = n_groups if rows is None else rows.numel()
        gpp = rows_per_program(group_p2, n_rows)
        wrap_triton(_encode_kernel)[(triton.cdiv(n_rows, gpp),)](
            x,
            offsets if rows is None else rows,  # (rows_ptr is read only with FLAGS)
            lo_p,
            step_p,
            fill,
            width,
            offsets,
            raw_rank,
            codes,
            raw_bits,
            n_viol,
            codes if flags is None else flags,  # (flags_ptr is written only with FLAGS)
            numel,
            n_rows,
            eb32,
            fmax,
            GROUP=group_size,
            GROUP_P2=group_p2,
            GPP=gpp,
            OUT_KIND=_DTYPES.index(dtype),
            FLAGS=flags is not None,
            INTERPRET=interpreting(),
            IDX64=(n_groups + gpp) * group_p2 >= 2**31,
            **LAUNCH_OPTIONS,
        )

    launch(None, None)
    exc_rows = ((n_viol > 0) | (n_bad > 0)).nonzero().view(-1)
    if exc_rows.numel():
        flags = torch.empty(exc_rows.numel(), group_size, dtype=torch.uint8, device=dev)
        launch(exc_rows, flags)
        where = flags.nonzero()
        exc_idx = exc_rows[where[:, 0]] * group_size + where[:, 1]
        exc_idx = exc_idx[exc_idx < numel]  # padding copies of the last value
    else:
        exc_idx = torch.zeros(0, dtype=torch.int64, device=dev)
    if exc_idx.numel():  # as the reference: from the float32 copy (NaN payload bits too)
        exc_val = x.reshape(-1).float()[exc_idx].to(dtype)
    else:
        exc_val = torch.zeros(0, dtype=dtype, device=dev)
    return {
        "width": width,
        "lo": lo_p,
        "step": step_p,
        "codes": codes,
        "raw": raw,
        "exc_idx": exc_idx,
        "exc_val": exc_val,
        "bound": eb,
    }


@triton_op("lightning_acgc::bounded_decode_core", mutates_args=())
def _decode_core(
    codes: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    width: torch.Tensor,
    offsets: torch.Tensor,
    raw_rank: torch.Tensor,
    raw: torch.Tensor,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One launch of the decode kernel (no exceptions restored)."""
    n_groups = lo.numel()
    group_p2 = next_power_of_2(group_size)
    gpp = rows_per_program(group_p2, n_groups)
    out = torch.empty(numel, dtype=dtype, device=lo.device)
    bits = _bits_dtype(dtype)
    wrap_triton(_decode_kernel)[(triton.cdiv(n_groups, gpp),)](
        codes,
        lo,
        step,
        width,
        offsets,
        raw_rank,
        raw.view(bits) if raw.numel() else out.view(bits),
        out.view(bits),
        numel,
        n_groups,
        torch.finfo(dtype).max,
        GROUP=group_size,
        GROUP_P2=group_p2,
        GPP=gpp,
        OUT_KIND=_DTYPES.index(dtype),
        INTERPRET=interpreting(),
        IDX64=(n_groups + gpp) * group_p2 >= 2**31,
        **LAUNCH_OPTIONS,
    )
    return out


def bounded_decode_triton(
    payload: dict[str, torch.Tensor],
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode a ``bounded`` payload (from either path) into a flat tensor.

    Args:
        payload: as the encoders write it.
        group_size: values per group.
        numel: values to decode (the original tensor's ``numel``).
        dtype: the original dtype (float32, float16 or bfloat16).

    Returns:
        A new flat tensor equal to ``bounded_decode_ref`` with the same arguments.

    Raises:
        RuntimeError: Triton cannot run on the payload's device.
        TypeError: a payload tensor has the wrong dtype.
        ValueError: unsupported ``dtype``, bad ``group_size``, or sizes that do not fit.
    """
    check_args(dtype, group_size)
    width, lo, step = payload["width"], payload["lo"], payload["step"]
    codes, raw = payload["codes"], payload["raw"]
    check_device(lo, "payload['lo']")
    check_dtype(width, "payload['width']", (torch.uint8,))
    check_dtype(lo, "payload['lo']", (torch.float32,))
    check_dtype(step, "payload['step']", (torch.float32,))
    check_dtype(codes, "payload['codes']", (torch.uint8,))
    check_dtype(raw, "payload['raw']", (dtype,))
    for name in ("width", "lo", "step", "codes", "raw"):
        check_contiguous(payload[name], f"payload['{name}']")
    n_groups = lo.numel()
    if width.numel() != n_groups or step.numel() != n_groups:
        raise ValueError("payload['width'], ['lo'] and ['step'] must have one value per group")
    if not (n_groups - 1) * group_size < numel <= n_groups * group_size:
        raise ValueError(f"numel={numel} does not match {n_groups} groups of {group_size}")
    offsets, raw_rank, n_code_bytes, n_raw = _layout(width, group_size)
    if codes.numel() != n_code_bytes or raw.numel() != n_raw * group_size:
        raise ValueError(
            f"payload sizes do not fit the widths: {n_code_bytes} code bytes and "
            f"{n_raw * group_size} raw values expected, got {codes.numel()} and {raw.numel()}"
        )
    out = _decode_core(codes, lo, step, width, offsets, raw_rank, raw, group_size, numel, dtype)
    return restore_exceptions(out, payload["exc_idx"], payload["exc_val"])
