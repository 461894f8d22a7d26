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
from torch.library import wrap_triton

from lightning_acgc.kernels.bounded.plan import (
    RAW_WIDTH,
    abs_bound,
    check_args,
    f32_down,
    group_plan,
)
from lightning_acgc.kernels.bounded.triton_jit import (
    _decode_kernel,
    _encode_kernel,
    _stats_kernel,
)
from lightning_acgc.kernels.common.nonfinite import restore_exceptions
from lightning_acgc.kernels.common.triton_utils import (
    LAUNCH_OPTIONS,
    check_contiguous,
    check_device,
    check_dtype,
    eager_or_op,
    interpreting,
    launchable,
    next_power_of_2,
    rows_per_program,
)

__all__ = ["bounded_decode_triton", "bounded_encode_triton"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


@eager_or_op("lightning_acgc::bounded_stats_core")
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
        launchable(_encode_kernel)[(triton.cdiv(n_rows, gpp),)](
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


@eager_or_op("lightning_acgc::bounded_decode_core")
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
