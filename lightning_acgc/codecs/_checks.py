"""Validation helpers shared by the codec configs (errors name field, value, allowed)."""

from __future__ import annotations

ALLOWED_BITS = (1, 2, 4, 8)  # what a user may set as ``bits``
QUANT_WIDTHS = tuple(range(1, 9))  # what the ``quant`` codec stores (acgc picks any)
BACKENDS = ("auto", "torch", "triton")


def check_bits(field: str, value: int, allowed: tuple[int, ...] = ALLOWED_BITS) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{field}={value!r} is not allowed; allowed values: {list(allowed)}")


def check_positive(field: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{field}={value!r} must be a number > 0")


def check_group_size(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 8:
        raise ValueError(f"{field}={value!r} must be a positive multiple of 8 (e.g. 256)")


def check_choice(field: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not allowed; allowed values: {list(allowed)}")


def check_share(field: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{field}={value!r} must be a number in [0, 1]")
