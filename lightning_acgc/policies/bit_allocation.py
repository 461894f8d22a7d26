"""Greedy bit allocation under an average-bit budget (GACT)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["LADDER", "allocate_bits"]

LADDER = (1, 2, 4, 8)


def _error(weight: float, bits: int) -> float:
    return weight / float(2**bits - 1) ** 2


def allocate_bits(sizes: Sequence[int], weights: Sequence[float], budget: float) -> list[int]:
    """Bits per tensor from {1, 2, 4, 8} minimizing Σ w_t / (2^b_t − 1)² subject to
    Σ n_t·b_t ≤ budget·Σ n_t: start every tensor at 1 bit, then repeatedly take the
    upgrade with the largest error reduction per added bit that still fits.

    Args:
        sizes: elements n_t of each tensor.
        weights: w_t = sensitivity × squared value range of each tensor.
        budget: average bits per element (1 to 8).

    Example:
        >>> allocate_bits([100, 100], [1.0, 100.0], budget=2.5)
        [1, 4]
    """
    if not 1 <= budget <= 8:
        raise ValueError(f"budget={budget!r} must be between 1 and 8 bits")
    bits = [LADDER[0]] * len(sizes)
    room = budget * sum(sizes) - sum(n * b for n, b in zip(sizes, bits, strict=True))
    heap: list[tuple[float, int]] = []

    def push(i: int) -> None:
        b = bits[i]
        if b == LADDER[-1] or sizes[i] == 0:
            return
        nxt = LADDER[LADDER.index(b) + 1]
        gain = (_error(weights[i], b) - _error(weights[i], nxt)) / (sizes[i] * (nxt - b))
        heapq.heappush(heap, (-gain, i))

    for i in range(len(sizes)):
        push(i)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        b = bits[i]
        nxt = LADDER[LADDER.index(b) + 1]
        cost = sizes[i] * (nxt - b)
        if cost > room + 1e-9:
            continue  # does not fit; smaller upgrades may
        if -neg_gain <= 0:
            break
        bits[i] = nxt
        room -= cost
        push(i)
    return bits
