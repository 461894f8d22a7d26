"""Timing shared by the benchmarks that compare configurations step by step (``speed``,
``fit_time``): interleaved rounds, and a step ratio with calibration amortized."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from benchmarks._machine import progress

__all__ = ["amortized", "interleaved"]

T = TypeVar("T")


def interleaved(
    rounds: int, configs: Sequence[str], measure: Callable[[str], T], label: str
) -> dict[str, list[T]]:
    """``measure(config)`` of every configuration once per round, each round starting one
    configuration further along (none always runs first, on a machine just warmed by
    another); per configuration, its readings in round order.

    Example:
        >>> calls = []
        >>> interleaved(3, ["a", "b"], lambda c: calls.append(c) or len(calls), "demo")
        {'a': [1, 4, 5], 'b': [2, 3, 6]}
        >>> calls
        ['a', 'b', 'b', 'a', 'a', 'b']
    """
    order = list(configs)
    readings: dict[str, list[T]] = {c: [] for c in order}
    for i in progress(range(rounds), label):
        start = i % len(order)
        for config in order[start:] + order[:start]:
            readings[config].append(measure(config))
    return readings


def amortized(step_ratio: float, step_s: float, calibration_s: float, every: int) -> float:
    """The ratio of a long fit: one step in ``every`` costs ``calibration_s`` instead of
    ``step_s``.

    Example:
        >>> amortized(1.2, 2.0, 6.0, 100)  # 4 s more each 100 steps of 2 s: 2% more
        1.224
    """
    return round(step_ratio * ((every - 1) * step_s + calibration_s) / (every * step_s), 3)
