"""The smallest widths that keep every module within its own budget, all at once.

Each weight op m may take ``B_m`` of error from the saved tensors that reach its gradient:
Σ_t c_{t,m}·v_t(b_t) ≤ B_m (c_{t,m}: tensor t's factor on m, analytic for m's own input,
measured by probes for the others; v_t(b): t's rounding variance per element at width b).
Where probes measured them, many tensors reach one module (attention's Q, K, V and
probabilities all reach its query and key projections), and one tensor reaches many.

Splitting each budget among its tensors in advance and holding each tensor alone to its
part (by elements, as :func:`~lightning_acgc.policies.acgc_allocation._element_shares`
still does for ``bounded``'s continuous bounds) is Lagrange-optimal for one budget and
continuous widths, but widths are whole and stop at 8 bits before 16: BERT-base's query
and value tensors each took 19-26% of their query projection's budget at 8 bits, where
all of that module's tensors at 8 bits fit within it (69%), yet their parts (by
elements, among every tensor reaching it) were a few percent each, so all went
to 16 bits (float16: twice 8 bits' bytes).

Here the constraints are met jointly: every tensor starts at its floor, then, while a
module is over its budget, the upgrade with the largest load reduction on the modules
over budget (each relative to its budget) per added bit is taken (capped at each module's
excess instead, small tensors climbed to float16 while a large one's last step was worth
little); then tensors step back down, most bits saved per load added first, wherever
every module they reach stays within its budget, until none can.

Used by :func:`~lightning_acgc.policies.acgc_allocation.quant_allocation`. On BERT-base
(batch 4, sequence 128, e = 0.05, probes on: ``probes=8``) Q, K and V went from 16 bits
to 8, 4.85x kept instead of 3.18x with the parts split beforehand, every layer within
e on the measured step (at ad7fe18; 5.23x since probed layers fill more of their
budget). Where each module is reached by one tensor (no probes: a weight op's input),
the widths are those of the split.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from lightning_acgc.policies.bit_allocation import KEEP, width_cost, widths_up

__all__ = ["joint_min_widths", "module_loads"]


def module_loads(
    factors: Sequence[dict[str, float]],
    variances: Sequence[dict[int, float]],
    widths: Sequence[int],
) -> dict[str, float]:
    """Σ_t c_{t,m}·v_t(b_t) per module (``KEEP``: no error).

    Example:
        >>> module_loads([{"fc": 2.0}, {"fc": 1.0}], [{1: 1.0}, {1: 3.0}], [1, 1])
        {'fc': 5.0}
    """
    loads: dict[str, float] = {}
    for c_t, v_t, w in zip(factors, variances, widths, strict=True):
        for m, c in c_t.items():
            loads[m] = loads.get(m, 0.0) + (0.0 if w == KEEP else c * v_t[w])
    return loads


def joint_min_widths(
    sizes: Sequence[int],
    factors: Sequence[dict[str, float]],
    variances: Sequence[dict[int, float]],
    budgets: dict[str, float],
    min_widths: Sequence[int],
    raw_bits: Sequence[int],
    overhead: float = 0.0,
    densities: Sequence[float] | None = None,
) -> list[int]:
    """Widths (``LADDER`` or ``KEEP``, at least ``min_widths``) for few bits Σ n_t·cost(b_t)
    such that every module m of ``budgets`` gets Σ_t c_{t,m}·v_t(b_t) ≤ B_m (module
    docstring). ``factors[t]``: c_{t,m} for the modules in ``budgets`` only;
    ``variances[t][b]``: per-element variance at each width of ``LADDER``.

    Example (two tensors on module ``a``, the second also on a tight ``b``):
        >>> from lightning_acgc.policies.bit_allocation import LADDER
        >>> v = {b: 4.0**-b for b in LADDER}
        >>> joint_min_widths([1000, 1000], [{"a": 1.0}, {"a": 1.0, "b": 100.0}], [v, v],
        ...                  {"a": 4.0**-4, "b": 4.0**-4}, [1, 1], [32, 32])
        [5, 8]
    """
    n = len(sizes)
    widths = list(min_widths)

    def var(i: int, w: int) -> float:
        return 0.0 if w == KEEP else variances[i][w]

    def cost(i: int, w: int) -> float:
        return width_cost(w, raw_bits[i], overhead, densities[i] if densities else 1.0)

    loads = module_loads(factors, variances, widths)
    users: dict[str, list[int]] = {}
    for i, c_t in enumerate(factors):
        for m in c_t:
            users.setdefault(m, []).append(i)

    def excess(m: str) -> float:
        return loads[m] - budgets[m]

    def gain(i: int) -> tuple[float, int] | None:
        up = widths_up(widths[i])
        if len(up) < 2 or not sizes[i]:
            return None
        w, nxt = up[0], up[1]
        drop = var(i, w) - var(i, nxt)
        relief = sum(c * drop / budgets[m] for m, c in factors[i].items() if excess(m) > 0)
        if relief <= 0:
            return None
        bits = max(cost(i, nxt) - cost(i, w), 1e-3)
        return relief / (sizes[i] * bits), nxt

    version = [0] * n
    heap: list[tuple[float, int, int, int]] = []

    def push(i: int) -> None:
        version[i] += 1
        g = gain(i)
        if g is not None:
            heapq.heappush(heap, (-g[0], i, g[1], version[i]))

    for i in range(n):
        push(i)
    while heap and any(excess(m) > 0 for m in loads):
        _, i, nxt, ver = heapq.heappop(heap)
        if ver != version[i]:
            continue
        drop = var(i, widths[i]) - var(i, nxt)
        widths[i] = nxt
        touched: set[int] = {i}
        for m, c in factors[i].items():
            loads[m] -= c * drop
            touched.update(users[m])
        for j in touched:  # their relief changed with these modules' excess
            push(j)
    # whole widths overshoot (the greedy may also have taken a big step, 8 -> 16 bits, for
    # what smaller steps of other tensors did later): step back down, most bits saved per
    # load added first, wherever every module reached stays within, until none can
    while True:
        down = []
        for i, w in enumerate(widths):
            if w != min_widths[i] and sizes[i]:
                ladder = widths_up(min_widths[i])
                lower = ladder[ladder.index(w) - 1]
                adds = {m: c * (var(i, lower) - var(i, w)) for m, c in factors[i].items()}
                added = max((a / budgets[m] for m, a in adds.items()), default=0.0)
                saved = cost(i, w) - cost(i, lower)
                down.append((-sizes[i] * saved / max(added, 1e-300), i, lower, adds))
        stepped = False
        for _, i, lower, adds in sorted(down, key=lambda d: d[:2]):
            if all(loads[m] + a <= budgets[m] for m, a in adds.items()):
                for m, a in adds.items():
                    loads[m] += a
                widths[i] = lower
                stepped = True
        if not stepped:
            break
    return widths
