"""Compiled CPU path of the ``bounded`` codec (``common/csrc/bounded.c``), bit-identical to
:mod:`lightning_acgc.kernels.bounded.reference` (the specification).

Three stages, as in the Triton launcher: C reduces each group's min, max, smallest
positive value and whether it holds a zero (one pass); C decides the per-group plan from
those ``G`` values with the float32 and float64 operations of
:func:`~lightning_acgc.kernels.bounded.plan.group_plan` (the specification, which the
reference and Triton run in torch), and :func:`_offsets` the byte offset of each group's
codes (as the decoder does); C rounds, packs at each group's width and checks the decoded
value of every element against the bound (second pass), listing the violators only when
there are some. Tensors holding NaN/inf, and float16 where the compiler has no
``_Float16``, go to the reference.
"""

from __future__ import annotations

import torch

from lightning_acgc.kernels.bounded import plan
from lightning_acgc.kernels.bounded.plan import (
    RAW_WIDTH,
    check_args,
)
from lightning_acgc.kernels.bounded.reference import bounded_decode_ref, bounded_encode_ref
from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads
from lightning_acgc.kernels.common.nonfinite import restore_exceptions
from lightning_acgc.kernels.common.small import cpu_empty, cpu_scalar

__all__ = ["bounded_decode_cpu", "bounded_encode_cpu"]

_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _supported(dtype: torch.dtype) -> bool:
    return dtype in _KIND and (dtype != torch.float16 or bool(cpu_library().acgc_has_f16()))


def _offsets(width: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """Byte offset of each group's codes, and the bytes of all codes (the format's
    cumsum of the coded widths, in C: a few torch ops on the G widths cost more)."""
    width = width.contiguous()
    offsets = torch.empty(width.numel(), dtype=torch.int64)
    total = cpu_library().acgc_bounded_offsets(
        width.data_ptr(), width.numel(), group_size, offsets.data_ptr()
    )
    return offsets, total


def _zero_group_signs(
    xf: torch.Tensor, group_size: int, lo: torch.Tensor, hi: torch.Tensor
) -> None:
    """Groups of zeros only store ``lo`` as written, and which of -0.0/+0.0 ``amin`` picks
    among mixed zeros is torch's choice: take it from torch for those groups (in place)."""
    zero = ((lo == 0) & (hi == 0)).nonzero().view(-1)
    if zero.numel():
        at = zero[:, None] * group_size + torch.arange(group_size)
        rows = xf[at.clamp_(max=xf.numel() - 1)]
        lo[zero], hi[zero] = rows.amin(dim=1), rows.amax(dim=1)


def _abs_bound(value_range: torch.Tensor, error_bound: float, relative: bool) -> float:
    """:func:`~lightning_acgc.kernels.bounded.plan.abs_bound` from the least min and the
    greatest max (float32, from C), in Python floats: the same float64 operations, without
    the torch calls on 0-d tensors that took a fifth of a small tensor's encode."""
    if not relative:
        return float(error_bound)
    least, greatest = value_range.tolist()
    return (greatest - least) * float(error_bound)


def bounded_encode_cpu(
    x: torch.Tensor, error_bound: float, group_size: int, relative: bool = False
) -> dict[str, torch.Tensor]:
    """Encode a non-empty CPU tensor; the same payload as ``bounded_encode_ref``.

    Example:
        >>> x = torch.linspace(-1, 1, 1000)
        >>> p = bounded_encode_cpu(x, 1e-3, 64)
        >>> y = bounded_decode_cpu(p, 64, x.numel(), x.dtype)
        >>> bool((y - x).abs().max() <= 1e-3)
        True
    """
    check_args(x.dtype, group_size)
    if not error_bound > 0 or error_bound == float("inf"):
        raise ValueError(f"error_bound={error_bound!r} must be a finite number > 0")
    if x.numel() == 0:
        raise ValueError("x is empty; keep empty tensors raw")
    lib = cpu_library()
    if not _supported(x.dtype):
        return bounded_encode_ref(x, error_bound, group_size, relative)
    xf = x.reshape(-1).to(torch.float32).contiguous()
    n, threads = xf.numel(), cpu_threads()
    groups = -(-n // group_size)
    # one allocation: lo, hi, smallest positive, range
    stats = torch.empty(3 * groups + 2, dtype=torch.float32)
    lo, hi, min_pos = (stats[k * groups : (k + 1) * groups] for k in range(3))
    has_zero = torch.empty(groups, dtype=torch.uint8)
    bad = lib.acgc_bounded_stats(
        xf.data_ptr(), n, group_size, lo.data_ptr(), hi.data_ptr(), min_pos.data_ptr(),
        has_zero.data_ptr(), stats[3 * groups :].data_ptr(), threads,
    )  # fmt: skip
    if bad == 1:  # NaN/inf: the reference sets them aside
        return bounded_encode_ref(x, error_bound, group_size, relative)
    if bad == 2:  # some group of zeros only
        _zero_group_signs(xf, group_size, lo, hi)
    eb = _abs_bound(stats[3 * groups :], error_bound, relative)
    kind = _KIND[x.dtype]
    width = torch.empty(groups, dtype=torch.uint8)
    lo_p, step_p = (
        torch.empty(groups, dtype=torch.float32),
        torch.empty(groups, dtype=torch.float32),
    )
    any_coded_raw = lib.acgc_bounded_plan(
        lo.data_ptr(), hi.data_ptr(), min_pos.data_ptr(), has_zero.data_ptr(), groups, eb,
        kind, plan._STEP_SLACK, plan._MAX_STEP, plan._GRID_MAX_K, width.data_ptr(),
        lo_p.data_ptr(), step_p.data_ptr(), threads,
    )  # fmt: skip
    coded_any, raw_any = any_coded_raw & 1, any_coded_raw & 2
    offsets, nbytes = _offsets(width, group_size)
    codes = torch.empty(nbytes, dtype=torch.uint8)
    check = bool(coded_any)  # the reference checks only where something is coded
    top = torch.finfo(x.dtype).max

    def pack(flags: torch.Tensor | None) -> int:
        """The violators' count (C rounds eb down to float32 for the check)."""
        return lib.acgc_bounded_pack(
            xf.data_ptr(), n, group_size, width.data_ptr(), lo_p.data_ptr(), step_p.data_ptr(),
            offsets.data_ptr(), eb, top, kind, int(check), codes.data_ptr(),
            None if flags is None else flags.data_ptr(), threads,
        )  # fmt: skip

    if pack(None) and check:  # rare: list the violators (a second pass)
        flags = torch.zeros(groups * group_size, dtype=torch.uint8)
        pack(flags)
        exc_idx = flags[:n].nonzero().view(-1)
        exc_val = xf[exc_idx].to(x.dtype)
    else:  # the common case: shared empty tensors (fresh ones were a tenth of the encode)
        exc_idx, exc_val = cpu_empty(torch.int64), cpu_empty(x.dtype)
    raw_groups = (width == RAW_WIDTH).nonzero().view(-1) if raw_any else None
    if raw_groups is not None:
        xpad = torch.cat([xf, xf[-1:].expand(groups * group_size - n)])
        raw_vals = xpad.view(groups, group_size).index_select(0, raw_groups).to(x.dtype)
        raw_vals = raw_vals.reshape(-1)
    else:
        raw_vals = cpu_empty(x.dtype)
    return {
        "width": width,
        "lo": lo_p,
        "step": step_p,
        "codes": codes,
        "raw": raw_vals,
        "exc_idx": exc_idx,
        "exc_val": exc_val,
        "bound": cpu_scalar(eb, torch.float64),
    }


def bounded_decode_cpu(
    payload: dict[str, torch.Tensor], group_size: int, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """Decode a payload (of any path) into a flat CPU tensor; ``bounded_decode_ref``'s values.

    Raises:
        ValueError: ``numel`` does not match the payload's groups.
    """
    check_args(dtype, group_size)
    width, lo, step = payload["width"], payload["lo"], payload["step"]
    if not _supported(dtype) or lo.dtype != torch.float32:
        return bounded_decode_ref(payload, group_size, numel, dtype)
    groups = width.numel()
    if not (groups - 1) * group_size < numel <= groups * group_size:
        raise ValueError(f"numel={numel} does not match {groups} groups of {group_size}")
    width, lo, step = width.contiguous(), lo.contiguous(), step.contiguous()
    offsets, nbytes = _offsets(width, group_size)
    codes = payload["codes"].contiguous()
    if codes.numel() != nbytes:
        raise ValueError(f"codes hold {codes.numel()} bytes, the widths need {nbytes}")
    kind = _KIND[dtype]
    out = torch.empty(groups * group_size, dtype=torch.float32 if kind == 0 else torch.int16)
    cpu_library().acgc_bounded_unpack(
        codes.data_ptr(), groups, group_size, width.data_ptr(), lo.data_ptr(), step.data_ptr(),
        offsets.data_ptr(), torch.finfo(dtype).max, kind, out.data_ptr(), cpu_threads(),
    )  # fmt: skip
    out = out if kind == 0 else out.view(dtype)
    raw = payload["raw"]
    if raw.numel():
        gi = (width == RAW_WIDTH).nonzero().view(-1)
        out.view(groups, group_size).index_copy_(0, gi, raw.view(-1, group_size).to(dtype))
    return restore_exceptions(out[:numel], payload["exc_idx"], payload["exc_val"])
