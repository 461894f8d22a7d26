"""AC-GC's allocation: from averaged sensitivities to per-tensor codec settings.

Both allocations hold the same two promises (see :mod:`lightning_acgc.policies.acgc`):

* per layer: a weight op's own saved input adds at most ``layer_share · E · ‖g_m‖² / μ_m``
  to its gradient's error (analytic factor ``c_{t,m}`` = fan_in·‖δ‖²);
* globally: the modelled total stays within ``E · ‖g‖²``, the other ops' (heuristic)
  factors weighted by λ.

``E`` = target · e² / κ. Sensitivities are ``(numel, {weight op: c_{t,m}}, other)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from lightning_acgc.codecs.registry import codec_config_class
from lightning_acgc.policies._schedule import round_bound_down
from lightning_acgc.policies.acgc_joint import joint_min_widths, module_loads
from lightning_acgc.policies.bit_allocation import KEEP, LADDER, QUANT_WIDTHS, allocate_to_error

__all__ = [
    "UNCONSTRAINED",
    "Sensitivity",
    "average",
    "bounded_bounds",
    "held_layer_sq",
    "layer_loads",
    "quant_allocation",
    "quant_meta_options",
]

UNCONSTRAINED = 1e30  # bound for a tensor no gradient depends on
ORDER = (*LADDER, KEEP)  # widths from the least to the most bits
SAFE_WIDTH = 8  # width of a tensor no gradient depends on (see quant_allocation)
# The share of each own budget a split may fill. Filled to 1, layers ran close to their
# budgets, overran more often and drew floors: the ResNet recipe calibrating every step
# for 40 steps kept a median 4.2x at e = 0.05 and 4.8x at e = 0.1 (whole widths: 4.8x,
# 5.5x); at 0.7, 4.8x and 5.7x (quick acgc_vs_fixed: half of the full fill's gain).
SPLIT_OWN_FILL = 0.7

Sensitivity = tuple[int, dict[str, float], float]


def quant_meta_options() -> dict[str, Any]:
    """bf16 group metadata (32 bits a group instead of 64) where this version's ``quant``
    codec offers it; read from its config at runtime so acgc works with either."""
    fields = {f.name for f in dataclasses.fields(codec_config_class("quant"))}
    return {"meta": "bf16"} if "meta" in fields else {}


def average(history: dict[str, Iterable[Sensitivity]]) -> dict[str, Sensitivity]:
    """Each tensor's sensitivity averaged over its readings (size: the latest).

    Example:
        >>> average({"t": [(4, {"fc": 1.0}, 2.0), (4, {"fc": 3.0}, 0.0)]})
        {'t': (4, {'fc': 2.0}, 1.0)}
    """
    out = {}
    for key, readings in history.items():
        hist = list(readings)
        weights: dict[str, float] = {}
        for _, w, _ in hist:
            for m, c in w.items():
                weights[m] = weights.get(m, 0.0) + c / len(hist)
        out[key] = (hist[-1][0], weights, sum(o for _, _, o in hist) / len(hist))
    return out


def layer_loads(sens: Mapping[str, Sensitivity]) -> dict[str, float]:
    """Per weight op m, the load Σ_t c_{t,m} of the saved tensors that reach it.

    Example:
        >>> layer_loads({"a": (4, {"fc": 2.0, "out": 1.0}, 0.5), "b": (4, {"fc": 1.0}, 0.0)})
        {'fc': 3.0, 'out': 1.0}
    """
    out: dict[str, float] = {}
    for _, weights, _ in sens.values():
        for m, c in weights.items():
            out[m] = out.get(m, 0.0) + c
    return out


def held_layer_sq(
    grad_sq: Sequence[dict[str, float]], load: dict[str, float], latest: dict[str, float]
) -> tuple[dict[str, float], dict[str, float]]:
    """Per module, from the last calibrations' ‖g_m‖² (``grad_sq``, each relative to its
    step's ‖g‖², the latest last) and the load Σ_t c_{t,m} of the tensors that reach it
    (``load``: of the averaged sensitivities the allocation reads; ``latest``: of the
    latest readings, :func:`layer_loads`): the mean ‖g_m‖², and the ‖g_m‖² its own
    budget takes, ``load`` times the latest reading's ‖g_m‖² / ``latest`` (at most the
    mean). A budget from the mean ‖g_m‖² let the calibration step whose ‖g_m‖² was small
    for its load break it (a char-LM's ``attn.qkv`` at 5-9x the previous readings' ratio
    measured 1.8e). The largest ratio of the last readings instead held BERT's query and
    key to their first steps' (the BERT recipe's fits: 7.2x -> 6.3x, 8.0x -> 6.0x).

    Example:
        >>> held_layer_sq([{"fc": 4.0}, {"fc": 1.0}], {"fc": 1.0}, {"fc": 1.0})
        ({'fc': 2.5}, {'fc': 1.0})
        >>> held_layer_sq([{"fc": 1.0}, {"fc": 4.0}], {"fc": 1.0}, {"fc": 1.0})[1]
        {'fc': 2.5}
    """
    mean: dict[str, float] = {}
    for reading in grad_sq:
        for m, v in reading.items():
            mean[m] = mean.get(m, 0.0) + v / len(grad_sq)
    held = dict(mean)
    for m, v in mean.items():
        g, c = grad_sq[-1].get(m), latest.get(m)
        if g and c:
            held[m] = min(v, load.get(m, 0.0) * g / c)
    return mean, held


def _layer_budgets(
    layer_sq: dict[str, float], e_sq: float, own_scale: Callable[[str], float], share: float
) -> dict[str, float]:
    """Per module with a gradient to compare with: the error the saved tensors that reach
    it may add (``share`` of its e²‖g_m‖², over its correction μ_m)."""
    return {m: share * e_sq * v / own_scale(m) for m, v in layer_sq.items() if v > 0}


def _element_shares(
    sens: dict[str, Sensitivity], budgets: dict[str, float]
) -> dict[str, dict[str, float]]:
    """Per tensor and module: the part of the module's budget (``budgets``) the tensor may
    use, split by elements among the tensors that reach it (the split of least bits where
    the variance falls 4x a bit, for continuous widths: the ``bounded`` codec's bounds).

    Example:
        >>> shares = _element_shares({"q": (100, {"attn": 1.0}, 0.0),
        ...                           "p": (300, {"attn": 1.0}, 0.0)}, {"attn": 1.0})
        >>> shares["q"]["attn"], shares["p"]["attn"]
        (0.25, 0.75)
    """
    elements: dict[str, int] = {}
    for n, weights, _ in sens.values():
        for m, c in weights.items():
            if c > 0 and m in budgets:
                elements[m] = elements.get(m, 0) + n
    return {
        key: {m: budgets[m] * n / elements[m] for m, c in w.items() if c > 0 and m in budgets}
        for key, (n, w, _) in sens.items()
    }


def _own_budgets(
    weights: dict[str, float], shares: dict[str, float]
) -> tuple[list[tuple[float, float]], float]:
    """(c_{t,m}, the tensor's part of op m's budget) per weight op with a gradient to
    compare with; the factors of weight ops without one (which join the global budget)."""
    own, orphan = [], 0.0
    for m, c in weights.items():
        if c > 0 and m in shares:
            own.append((c, shares[m]))
        elif c > 0:
            orphan += c
    return own, orphan


def bounded_bounds(
    sens: dict[str, Sensitivity],
    layer_sq: dict[str, float],
    g_sq: float,
    e_sq: float,
    lam: float,
    own_scale: Callable[[str], float],
    layer_share: float,
) -> dict[str, float]:
    """Error bounds of the ``bounded`` codec (variance ≤ eb²/3): each weight op's input
    meets its own budget; the other ops share ``(1 − layer_share) · E · ‖g‖² / λ`` in
    proportion to their size."""
    others = sum(n for n, _, o in sens.values() if o > 0)
    bounds = {}
    budgets = _layer_budgets(layer_sq, e_sq, own_scale, layer_share)
    shares = _element_shares(sens, budgets)
    for key, (n, weights, other) in sens.items():
        own, orphan = _own_budgets(weights, shares[key])
        other += orphan
        eb = min((math.sqrt(3 * b / c) for c, b in own), default=UNCONSTRAINED)
        if other > 0:
            rest = (1 - layer_share) * e_sq * g_sq / lam
            eb = min(eb, math.sqrt(3 * rest * n / (max(others, n) * other)))
        bounds[key] = round_bound_down(min(max(eb, 1e-30), UNCONSTRAINED))
    return bounds


def _own_room(own: list[tuple[float, float]], v: dict[int, float], width: int) -> float:
    """The largest share f of a tensor's values at ``width − 1`` that keeps each of its
    own budgets filled to at most ``SPLIT_OWN_FILL``:
    (1 − f)·c·v(width) + f·c·v(width − 1) ≤ SPLIT_OWN_FILL · budget for every (c, budget)."""
    room = 1.0
    for c, bud in own:
        added = c * (v[width - 1] - v[width])
        if added > 0:
            room = min(room, (SPLIT_OWN_FILL * bud - c * v[width]) / added)
    return max(room, 0.0)


def _low_shares(
    widths: list[int],
    errors: list[dict[int, float]],
    rooms: list[float],
    mins: list[int],
    sizes: list[int],
    slack: float,
) -> list[float]:
    """Per tensor, the share of its values that may take one bit less than ``widths``
    (the ``split`` codec): at most ``rooms`` (its own budgets' limit, :func:`_own_room`),
    none below its floor (``mins``), the global ``slack`` given to the tensors that save
    the most bits per error added first. Shares are rounded down to sixteenths (few
    distinct codecs; the error stays within).

    Example:
        >>> errs = [{b: 4.0 ** -b for b in range(1, 9)}]
        >>> _low_shares([3], errs, [1.0], [1], [100], slack=4.0 ** -3)  # 2 bits: 4x the error
        [0.3125]
    """
    shares = [0.0] * len(widths)
    order = []
    for i, w in enumerate(widths):
        if w not in QUANT_WIDTHS[1:] or ORDER.index(w - 1) < ORDER.index(mins[i]):
            continue
        added = errors[i][w - 1] - errors[i][w]
        if math.isfinite(added) and added > 0 and sizes[i]:
            order.append((-sizes[i] / added, i, added))
    for _, i, added in sorted(order):
        f = math.floor(max(min(rooms[i], slack / added, 1.0), 0.0) * 16) / 16
        shares[i] = f
        slack -= f * added
    return shares


def _joint_parts(
    keys: list[str],
    sens: dict[str, Sensitivity],
    variances: dict[str, list[float]],
    budgets: dict[str, float],
    raw_bits: dict[str, int],
    overhead: float,
    floors: dict[str, int] | None,
    nonzero_share: list[float],
) -> tuple[dict[str, int], dict[str, dict[str, float]]]:
    """The widths that meet every budget jointly
    (:func:`~lightning_acgc.policies.acgc_joint.joint_min_widths`), and per tensor and
    module: its part of the module's budget, its load at those widths plus, of what the
    module has left, a share by elements (what a ``split`` may fill, :func:`_own_room`)."""
    factors, tables, mins = [], [], []
    for key in keys:
        _, weights, _ = sens[key]
        table = dict(zip(LADDER, variances[key], strict=True))
        finite = [b for b in LADDER if math.isfinite(table[b])]
        factors.append({m: c for m, c in weights.items() if c > 0 and m in budgets})
        tables.append({b: table[b] if math.isfinite(table[b]) else 0.0 for b in LADDER})
        first = finite[0] if finite else KEEP
        mins.append(max(first, (floors or {}).get(key, LADDER[0]), key=ORDER.index))
    sizes = [sens[k][0] for k in keys]
    raws = [raw_bits.get(k, 32) for k in keys]
    widths = joint_min_widths(sizes, factors, tables, budgets, mins, raws, overhead, nonzero_share)
    loads = module_loads(factors, tables, widths)
    elements: dict[str, int] = {}
    for n, c_t in zip(sizes, factors, strict=True):
        for m in c_t:
            elements[m] = elements.get(m, 0) + n
    parts: dict[str, dict[str, float]] = {}
    for key, n, c_t, t, w in zip(keys, sizes, factors, tables, widths, strict=True):
        mine = parts[key] = {}
        for m, c in c_t.items():
            left = max(SPLIT_OWN_FILL * budgets[m] - loads[m], 0.0) * n / elements[m]
            mine[m] = ((0.0 if w == KEEP else c * t[w]) + left) / SPLIT_OWN_FILL
    return dict(zip(keys, widths, strict=True)), parts


def quant_allocation(
    sens: dict[str, Sensitivity],
    variances: dict[str, list[float]],
    layer_sq: dict[str, float],
    g_sq: float,
    e_sq: float,
    lam: Callable[[str], float],
    own_scale: Callable[[str], float],
    layer_share: float,
    raw_bits: dict[str, int],
    overhead: float,
    floors: dict[str, int] | None = None,
    densities: dict[str, float] | None = None,
    exact: Collection[str] = (),
) -> tuple[dict[str, int], dict[str, float]]:
    """Widths of the ``quant`` codec (``KEEP``: not compressed) for the tensors with a
    measured variance table (``variances[t][i]``: per-element variance at ``LADDER[i]``),
    and the share of each tensor's values stored one bit narrower (``split`` codec).

    Tensors start at the fewest bits that keep each module within its own budget, all
    the tensors that reach it together (:func:`_joint_parts`; ``KEEP`` where float16
    does not); then greedy upgrades, best error reduction per added bit first, bring
    Σ_t (w_t + λ_t·o_t)·v_t(b_t) within ``E · ‖g‖²`` (``lam(t)``: λ of tensor t's
    scope). A tensor no gradient depends on (sensitivity 0: its module's output gradient
    was exactly zero) is neither measured by the model nor by the gradient error, so it
    is kept at a safe 8 bits rather than trusted to a model that has no reading for it.
    ``floors``: smallest width per tensor from measured per-layer errors
    (:mod:`lightning_acgc.policies.acgc_floors`). ``densities``: per tensor stored by the
    ``nonzero`` codec, its share of non-zero values (what its widths cost: a mask bit
    per value, the width for that share). ``exact``: tensors whose sensitivity is 0
    because the model knows their rounding adds no error at or above their floor (a
    ReLU output read only through its mask): at the floor, not ``SAFE_WIDTH``.

    Widths step coarsely (a bit is about 4x the variance), so the smallest width that
    meets a budget lands anywhere between a quarter of it and all of it; what is left,
    of the own budgets and of the global one, lowers a share of each tensor's values by
    one bit (:func:`_low_shares`).
    """
    keys = sorted(k for k in sens if k in variances)
    sizes, errors, mins, raws, owns, floor_list = [], [], [], [], [], []
    budgets = _layer_budgets(layer_sq, e_sq, own_scale, layer_share)
    nonzero_share = [(densities or {}).get(k, 1.0) for k in keys]
    args = (raw_bits, overhead, floors, nonzero_share)
    joint, parts = _joint_parts(keys, sens, variances, budgets, *args)
    for key in keys:
        n, weights, other = sens[key]
        v = dict(zip(LADDER, variances[key], strict=True))
        own, orphan = _own_budgets(weights, parts[key])
        factor = sum(weights.values()) - orphan + lam(key) * (other + orphan)
        floor = (floors or {}).get(key, LADDER[0])
        width = (floor if key in exact else SAFE_WIDTH) if factor <= 0 else joint[key]
        sizes.append(n)
        errors.append({b: factor * v[b] for b in LADDER})
        mins.append(max(width, floor, key=ORDER.index))
        raws.append(raw_bits.get(key, 32))
        owns.append((own, v) if factor > 0 else None)  # SAFE_WIDTH stays whole
        floor_list.append(floor)
    widths = allocate_to_error(sizes, errors, e_sq * g_sq, mins, raws, overhead, nonzero_share)
    rooms = [
        _own_room(*o, w) if o is not None and w in QUANT_WIDTHS[1:] else 0.0
        for o, w in zip(owns, widths, strict=True)
    ]
    slack = e_sq * g_sq - sum(e[w] for e, w in zip(errors, widths, strict=True) if w != KEEP)
    stored = [n * d for n, d in zip(sizes, nonzero_share, strict=True)]  # the values coded
    low_shares = _low_shares(widths, errors, rooms, floor_list, stored, slack)
    return (
        dict(zip(keys, widths, strict=True)),
        {k: f for k, f in zip(keys, low_shares, strict=True) if f > 0},
    )
