"""Per-group decisions of the ``bounded`` codec (widths, steps, raw groups), shared by the
torch reference and the Triton launcher; the format is described in
:mod:`lightning_acgc.kernels.bounded.reference`."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "MAX_WIDTH",
    "RAW_WIDTH",
    "SUPPORTED_DTYPES",
    "GroupPlan",
    "abs_bound",
    "check_args",
    "f32_down",
    "group_plan",
]

MAX_WIDTH = 16
"""Widest code in bits (16-bit dtypes: 15); wider groups are kept raw."""
RAW_WIDTH = 255
"""``width`` value of a raw group."""

# dtype -> (mantissa bits, exponent of the smallest normal, total bits)
_FORMATS: dict[torch.dtype, tuple[int, int, int]] = {
    torch.float32: (23, -126, 32),
    torch.float16: (10, -14, 16),
    torch.bfloat16: (7, -126, 16),
}
SUPPORTED_DTYPES = tuple(_FORMATS)
_STEP_SLACK = 1.0 - 2.0**-6  # covers float32 rounding of (x - lo) / step at 16-bit codes
_MAX_STEP = 2.0**126  # keeps step and (x - lo) / step finite in float32
_GRID_MAX_K = 2.0**12  # beyond, the margin costs nothing and k * ulp may not be exact


def _ulp(mag: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` values in the binade of ``mag`` (float64, >= 0): every value
    of magnitude ``<= mag`` rounds to ``dtype`` with an error of at most half of it."""
    mant, emin, _ = _FORMATS[dtype]
    # 2^floor(log2 mag), exactly: keep only the float64 exponent bits.
    pow2 = (mag.contiguous().view(torch.int64) & 0x7FF0_0000_0000_0000).view(torch.float64)
    return torch.clamp(pow2 * 2.0**-mant, min=2.0 ** (emin - mant))


def f32_down(v: torch.Tensor) -> torch.Tensor:
    """float64 -> the largest float32 ``<= v`` (float32 max for larger values)."""
    f = v.float()
    return torch.where(f.double() > v, torch.nextafter(f, torch.zeros_like(f)), f)


def abs_bound(
    lo: torch.Tensor,
    hi: torch.Tensor,
    has_finite: torch.Tensor | None,
    error_bound: float,
    relative: bool,
) -> torch.Tensor:
    """The absolute bound as a float64 0-d tensor."""
    if not relative:
        return torch.tensor(float(error_bound), dtype=torch.float64, device=lo.device)
    if has_finite is not None:
        lo, hi = lo[has_finite], hi[has_finite]
    if lo.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=lo.device)
    return (hi.max().double() - lo.min().double()) * float(error_bound)


def check_args(dtype: torch.dtype, group_size: int) -> None:
    if dtype not in _FORMATS:
        allowed = [str(d) for d in SUPPORTED_DTYPES]
        raise ValueError(f"dtype={dtype} is not supported; allowed dtypes: {allowed}")
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"group_size={group_size!r} must be a positive multiple of 8")


def _group_steps(
    lo: torch.Tensor,
    hi: torch.Tensor,
    base: torch.Tensor,
    const: torch.Tensor,
    eb: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (step, base): the largest float32 step whose rounding error plus the
    float32 decode arithmetic and the cast to ``dtype`` stays within ``eb``."""
    mag = torch.maximum(lo.double().abs(), hi.double().abs()) + eb
    err = 3.0 * _ulp(mag, torch.float32)
    if dtype != torch.float32:
        err = err + 0.5 * _ulp(mag, dtype)
    step = f32_down(torch.clamp(2.0 * (eb - err) * _STEP_SLACK, max=_MAX_STEP))
    if dtype != torch.float32:
        # On the dtype's grid at the group's magnitude the decode is exact: a step of
        # k * ulp and a base floored to that grid need no margin for the cast.
        ulp = _ulp(mag, dtype)
        k = torch.floor(2.0 * eb * _STEP_SLACK / ulp)
        grid_base = torch.floor(base.double() / ulp) * ulp
        # (a non-negative group keeps a positive base: positives stay positive)
        grid = ~const & (k >= 1) & (k <= _GRID_MAX_K) & ((grid_base > 0) | (lo < 0))
        grid &= mag <= torch.finfo(dtype).max  # the grid's ends must not overflow dtype
        step = torch.where(grid, (k * ulp).float(), step)
        base = torch.where(grid, grid_base.float(), base)
    return step, base


class GroupPlan(NamedTuple):
    """Each group's kind and parameters, as the encoders decide them (``G`` values each)."""

    width: torch.Tensor  # uint8 payload width (0 constant, 1..16 coded, 255 raw)
    lo: torch.Tensor  # float32 payload lo
    step: torch.Tensor  # float32 payload step (negative when zero-kept)
    zero_kept: torch.Tensor  # bool
    coded: torch.Tensor  # bool
    raw: torch.Tensor  # bool


def group_plan(
    lo: torch.Tensor,
    hi: torch.Tensor,
    eb: torch.Tensor,
    dtype: torch.dtype,
    has_zero: Callable[[], torch.Tensor],
    min_pos: Callable[[], torch.Tensor],
) -> GroupPlan:
    """The per-group decisions of the format from the group statistics, shared by the
    torch and the Triton encoders so that both write the same payload.

    Args:
        lo, hi: float32 (G,) min and max of each group's finite values (NaN/inf replaced).
        eb: the absolute bound, float64 0-d.
        dtype: the input dtype.
        has_zero: returns bool (G,), whether a group holds an exact 0 (read only for
            groups holding both signs; called only if there are such groups).
        min_pos: returns float32 (G,), each group's smallest positive value (read only
            for groups whose minimum is 0; called only if there are such groups).
    """
    # Zero-kept groups: an exact 0 next to other values. Base: smallest nonzero value.
    const = lo == hi
    zero_lo = (lo == 0) & ~const
    zero_kept = zero_lo | ((hi == 0) & ~const)
    mixed = (lo < 0) & (hi > 0)
    if bool(mixed.any()):
        zero_kept |= mixed & has_zero()
    base = torch.where(zero_lo, min_pos(), lo) if bool(zero_lo.any()) else lo
    step, base = _group_steps(lo, hi, base, const, eb, dtype)

    # Width from the largest code, computed exactly as the codes are (monotone in x).
    max_width = min(MAX_WIDTH, _FORMATS[dtype][2] - 1)
    top = (hi - base).div_(step).round_() + zero_kept.float()
    coded = ~const & (step > 0) & (top <= float(2**max_width - 1))  # NaN/inf fail
    raw = ~const & ~coded
    bits = torch.frexp(torch.where(coded, top, 0.0))[1]  # bit length of the largest code
    width = bits.masked_fill_(raw, RAW_WIDTH).to(torch.uint8)
    lo_p = torch.where(raw, 0.0, base)
    step_p = torch.where(coded, torch.where(zero_kept, -step, step), 0.0)
    return GroupPlan(width, lo_p, step_p, zero_kept, coded, raw)
