"""Greedy bit allocation under an average-bit budget (GACT)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = [
    "HALF",
    "KEEP",
    "LADDER",
    "POW2",
    "QUANT_WIDTHS",
    "allocate_bits",
    "allocate_to_error",
    "width_cost",
    "widths_up",
]

POW2 = (1, 2, 4, 8)  # the widths users set (and GACT allocates)
QUANT_WIDTHS = tuple(range(1, 9))  # the widths ``quant`` stores
HALF = 16  # the ``half`` codec (float16, no metadata): the step between 8 bits and keeping
LADDER = (*QUANT_WIDTHS, HALF)  # the widths acgc allocates, from the least to the most bits


def _error(weight: float, bits: int) -> float:
    return weight / float(2**bits - 1) ** 2


def allocate_bits(sizes: Sequence[int], weights: Sequence[float], budget: float) -> list[int]:
    """Bits per tensor from ``POW2`` = {1, 2, 4, 8} minimizing Σ w_t / (2^b_t − 1)² subject to
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
    bits = [POW2[0]] * len(sizes)
    room = budget * sum(sizes) - sum(n * b for n, b in zip(sizes, bits, strict=True))
    heap: list[tuple[float, int]] = []

    def push(i: int) -> None:
        b = bits[i]
        if b == POW2[-1] or sizes[i] == 0:
            return
        nxt = POW2[POW2.index(b) + 1]
        gain = (_error(weights[i], b) - _error(weights[i], nxt)) / (sizes[i] * (nxt - b))
        heapq.heappush(heap, (-gain, i))

    for i in range(len(sizes)):
        push(i)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        b = bits[i]
        nxt = POW2[POW2.index(b) + 1]
        cost = sizes[i] * (nxt - b)
        if cost > room + 1e-9:
            continue  # does not fit; smaller upgrades may
        if -neg_gain <= 0:
            break
        bits[i] = nxt
        room -= cost
        push(i)
    return bits


KEEP = 0  # a width meaning "not compressed" (the tensor is kept as it is)


def width_cost(width: int, raw_bits: int, overhead: float, density: float = 1.0) -> float:
    """Bits per element at ``width``: ``raw_bits`` kept as it is, none of metadata at
    ``HALF``, ``overhead`` added to a quantized width. A ``density`` under 1 is a tensor
    stored by the ``nonzero`` codec: a mask bit per element, and the quantized width and
    its metadata for that share of its elements only.

    Example:
        >>> width_cost(KEEP, 32, 0.125), width_cost(HALF, 32, 0.125), width_cost(2, 32, 0.125)
        (32, 16, 2.125)
        >>> width_cost(6, 32, 0.125, density=0.4)  # 1 + 0.4 * 6.125
        3.45
    """
    if width in (KEEP, HALF):
        return raw_bits if width == KEEP else width
    quantized = width + overhead
    return quantized if density >= 1 else 1 + density * quantized


def widths_up(min_width: int) -> tuple[int, ...]:
    """The widths a tensor may take at or above ``min_width`` (``KEEP`` last)."""
    ladder = (*LADDER, KEEP)
    return ladder[ladder.index(min_width) :]


def allocate_to_error(
    sizes: Sequence[int],
    errors: Sequence[dict[int, float]],
    budget: float,
    min_widths: Sequence[int],
    raw_bits: Sequence[int],
    overhead: float = 0.0,
    densities: Sequence[float] | None = None,
) -> list[int]:
    """Widths from ``LADDER`` (1 to 8 bits, ``HALF``) or ``KEEP`` that bring the total error
    Σ errors[t][b_t] within ``budget`` for few bits Σ n_t·b_t: start every tensor at its
    ``min_widths`` entry, then take, while over budget, the upgrade with the largest error
    reduction per added bit (a tensor kept as it is costs ``raw_bits`` per element, no error);
    then step back down by one width, most bits saved per error added first, each tensor
    whose step down still fits in the budget.

    Args:
        sizes: elements n_t of each tensor.
        errors: per tensor, its modelled error at each width of ``LADDER``.
        budget: the total error allowed.
        min_widths: the smallest width each tensor may take (its own, per-layer limit).
        raw_bits: bits per element of each tensor kept as it is (32 for float32).
        overhead: bits per element a quantized tensor adds for its metadata (``HALF``
            has none).
        densities: per tensor, the share of its elements a quantized width stores (1,
            the default: all; under 1: the ``nonzero`` codec, see :func:`width_cost`).

    Example:
        >>> errs = [{b: c / (2**b - 1) ** 2 for b in LADDER} for c in (9.0, 0.9)]
        >>> allocate_to_error([100, 100], errs, budget=0.5, min_widths=[1, 1], raw_bits=[32] * 2)
        [3, 2]
    """

    def err(i: int, b: int) -> float:
        return 0.0 if b == KEEP else errors[i][b]

    def cost(i: int, b: int) -> float:
        return width_cost(b, raw_bits[i], overhead, densities[i] if densities else 1.0)

    widths = list(min_widths)
    total = sum(err(i, b) for i, b in enumerate(widths))
    heap: list[tuple[float, int, int]] = []

    def push(i: int) -> None:
        up = widths_up(widths[i])
        if len(up) < 2 or sizes[i] == 0:
            return
        b, nxt = up[0], up[1]
        gain = (err(i, b) - err(i, nxt)) / (sizes[i] * max(cost(i, nxt) - cost(i, b), 1e-3))
        heapq.heappush(heap, (-gain, i, nxt))

    for i in range(len(sizes)):
        push(i)
    while total > budget and heap:
        _, i, nxt = heapq.heappop(heap)
        total += err(i, nxt) - err(i, widths[i])
        widths[i] = nxt
        push(i)
    # Widths step coarsely (1 -> 2 bits: 9x less error; 7 -> 8: 4x), so the last upgrades
    # can overshoot: give back, most bits saved per error added first, what still fits.
    down = []
    for i, b in enumerate(widths):
        if b != min_widths[i] and sizes[i]:
            lower = widths_up(min_widths[i])[widths_up(min_widths[i]).index(b) - 1]
            added = err(i, lower) - err(i, b)
            saved = sizes[i] * (cost(i, b) - cost(i, lower))
            down.append((-saved / max(added, 1e-300), i, lower))
    for _, i, lower in sorted(down):
        added = err(i, lower) - err(i, widths[i])
        if total + added <= budget:
            total += added
            widths[i] = lower
    return widths
