"""Shared pieces of the calibrating policies: schedule checks, bound rounding, option checks."""

from __future__ import annotations

import math

__all__ = ["check_int", "is_calibration_step", "round_bound_down"]


def check_int(field: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field}={value!r} must be an int >= {minimum}")


def is_calibration_step(step: int, calibrate_every: int, warmup_steps: int) -> bool:
    """The first ``warmup_steps`` steps of fit, then every ``calibrate_every`` steps."""
    return step < warmup_steps or step % calibrate_every == 0


def round_bound_down(bound: float) -> float:
    """Round down to a power of 2**(1/4): keeps few distinct codecs (and identical ones
    across ranks whose statistics differ in the last bits). Never rounds up.

    Example:
        >>> round_bound_down(1.0), round_bound_down(0.3) <= 0.3
        (1.0, True)
    """
    k = math.floor(4 * math.log2(bound) + 1e-9)
    return 2.0 ** (k / 4)
