"""How far acgc's next allocation may loosen its global budget: as far as the layers'
errors through δ leave room (``quant`` codec).

A weight op's own saved input is budgeted per layer; the errors that reach a layer
through δ (from the other-ops tensors around it: an attention's q, k, v and
probabilities for its query and key projections, a block's norm inputs for the layers
after them) only through the global budget E‖g‖²·aim/κ. κ falls at most 2x a reading
over the first calibrations, and as it falls every other-ops tensor loses bits wherever
the whole model has room, also around a layer whose gradient is 10⁻⁹ of ‖g‖²; the floors
(:mod:`~.acgc_floors`) step in only once that layer has broken its promise. Over the
sweep's fits at the default (calibrating every 5 steps) the per-layer breaks clustered
on the first calibration at the full budget (step 5): the char-LM's attention
projections at 1.13-1.2x their bound, the causal LMs' query and key projections at up
to 4x.

So each verified calibration reads its worst layer's error through δ against the
room its own input leaves of its budget, at least the δ share (:func:`delta_reading`, in
:meth:`~.acgc_corrections.ModelCorrections._measure_layers`; 1: that room filled), and
the next allocation's aim/κ may grow by its inverse at most (not at all where a layer
was at or over it). The errors through δ grow with the global budget
as the other-ops tensors lose bits, so a layer at half its share may take 2x more, one
at its share no more. The per-layer budgets of the weight ops' own inputs are not held
by it (they are modelled per layer: :func:`held_budget` lifts them back). κ keeps its
meaning (measured / modelled at the settings in force); only the budget the allocation
reads is held. Logged as ``budget_held``
(aim/κ over what the allocation took; 1 where nothing was held).

Measured on the sweep's fits at the default (``benchmarks/promise.py``, 282 verified
calibrations): both promises kept on 281 (279 without the limit; 282 with the δ part read
against the δ share alone), on the step after each calibration 244 of 248 (241 without);
the median calibration's global error 0.33e either way. On BERT-base (the memory
benchmark's case) the reading against the δ share held every allocation at 17.6x; read
against the room, 19.4x after three calibrations, 20x after five.
"""

from __future__ import annotations

__all__ = ["delta_reading", "held_budget", "next_limit"]


def delta_reading(err: float, own: float, budget: float, share: float) -> float:
    """A layer's error through δ (``err`` measured less ``own``, its own input's modelled
    part) over the room its own input leaves of its ``budget`` (target · e_m²‖g_m‖²), at
    least the δ share ``1 − share`` of it: a query projection's own input may use a few
    percent of its budget (the module docstring has what the δ share alone cost).

    Example:
        >>> delta_reading(0.3, 0.0, 1.0, 0.8)  # own input unused: all the room is δ's
        0.3
        >>> delta_reading(0.9, 0.8, 1.0, 0.8)  # own input at its share: δ has the fifth
        0.5
    """
    return max(err - own, 0.0) / max(budget - own, (1.0 - share) * budget)


def next_limit(used: float | None, readings: dict[str, float]) -> float | None:
    """The largest aim/κ the next allocation may take, after one that took ``used`` and
    whose layers read ``readings`` (per module held to e: :func:`delta_reading`):
    ``used`` times the worst reading's inverse where it leaves room, ``used`` where it
    does not; ``None`` (no limit) where no layer took error through δ or no allocation
    was made (``used`` None).

    Example:
        >>> next_limit(2.0, {"a": 0.5, "b": 0.25})
        4.0
        >>> next_limit(2.0, {"a": 1.5}), next_limit(2.0, {"a": 0.0}), next_limit(2.0, {})
        (2.0, None, None)
    """
    worst = max(readings.values(), default=0.0)
    return used * max(1.0, 1.0 / worst) if worst > 0 and used is not None else None


def held_budget(scale: float, limit: float | None) -> tuple[float, float]:
    """(aim/κ as the allocation takes it, how many times ``scale`` it was held below):
    the per-layer budgets are lifted by the second to stay where ``scale`` puts them.

    Example:
        >>> held_budget(8.0, 2.0), held_budget(1.0, 2.0), held_budget(8.0, None)
        ((2.0, 4.0), (1.0, 1.0), (8.0, 1.0))
    """
    if limit is None or scale <= limit:
        return scale, 1.0
    return limit, scale / limit
