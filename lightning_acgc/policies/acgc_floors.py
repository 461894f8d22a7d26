"""Per-tensor width floors from measured per-layer errors (AC-GC, ``quant`` codec).

The error a layer's gradient gets through δ comes mostly from the other-ops tensors
saved next to it: attention's query and key gradients are made of the attention's own
saved tensors (Q, K, V, the probabilities), whose errors do not cancel in the softmax's
backward the way the signal does. At initialization those gradients are 1e-8 of ‖g‖²,
so no global weight λ on the other-ops factors can reach them (λ ran to 256 on BERT and
query/key still measured 8-10x e).

So the measurement acts directly. When a module m's measured error through δ is over
its budget by r (:meth:`ModelCorrections._measure_layers`), the other-ops tensors saved
inside m's parent scope (their module is the parent or below it) get floors: starting
from their widths in force, the fewest added bits (greedy, best modelled error reduction
per bit, :func:`~lightning_acgc.policies.bit_allocation.allocate_to_error`) that cut the
scope's modelled other-ops error Σ o_t·v_t(b_t) by ``MARGIN``·r. Unbiased errors add in variance,
so r is what would have put m on budget; which tensors carry it is the model's guess (the
next calibration corrects it). A floor loosens by at most one width step per
calibration, and only when the scope's worst module had room for that step's variance
(v_t(lower) / v_t(floor) times its measured error within its budget; from kept to 8 bits
when it used under half its budget).
"""

from __future__ import annotations

from lightning_acgc.policies.bit_allocation import KEEP, LADDER, allocate_to_error

__all__ = ["ScopeFloors", "within"]

ORDER = (*LADDER, KEEP)  # widths from the least to the most bits
# A floor cuts the modelled error by MARGIN·r, not r: which tensors carry a layer's error
# is the model's guess, and one width step (2-4x the error) rarely lands exactly; a floor
# that falls short costs another calibration over budget, one too high loosens later.
MARGIN = 2.0


def parent(module: str) -> str:
    """The module's parent scope ("" at the root)."""
    return module.rpartition(".")[0]


def within(module: str, scope: str) -> bool:
    """Whether ``module`` is ``scope`` or below it (the root "" contains every module).

    Example:
        >>> within("a.b.c", "a.b"), within("a.bc", "a.b"), within("x", "")
        (True, False, True)
    """
    return not scope or module == scope or module.startswith(scope + ".")


def _variance(table: list[float], width: int) -> float:
    return 0.0 if width == KEEP else table[LADDER.index(width)]


class ScopeFloors:
    """Mixin of :class:`~lightning_acgc.policies.acgc.ACGCPolicy`: ``_floors`` (site key →
    smallest width) from the per-layer readings. Uses ``site_bits``, ``_variances``,
    ``_sens``, ``_raw_bits`` and ``initial_width``."""

    def _update_floors(self, needs: dict[str, float], through_delta: dict[str, float]) -> None:
        """Tighten or loosen the floors of the other-ops tensors around each module.

        Args:
            needs: per module, measured error / budget.
            through_delta: per module, its error not from its own input / that part's budget.
        """
        floors: dict[str, int] = getattr(self, "_floors", None) or {}
        scope_over: dict[str, float] = {}
        scope_need: dict[str, float] = {}
        for module, r in needs.items():
            scope = parent(module)
            scope_need[scope] = max(scope_need.get(scope, 0.0), r)
            if r > 1 and through_delta.get(module, 0.0) > 1:
                scope_over[scope] = max(scope_over.get(scope, 0.0), through_delta[module])
        others = {
            key: sum(o for _, _, o in readings) / len(readings)
            for key, readings in self._sens.items()
            if key in self._variances
        }
        others = {k: o for k, o in others.items() if o > 0}
        # innermost scopes first: a tensor tightened for an inner scope counts as such
        for scope in sorted(scope_over, key=lambda s: -s.count(".") - bool(s)):
            keys = sorted(k for k in others if within(k.rpartition(":")[0], scope))
            if not keys:
                continue
            widths = [
                max(
                    self.site_bits.get(k, self.initial_width),
                    floors.get(k, LADDER[0]),
                    key=ORDER.index,
                )
                for k in keys
            ]
            errors = [
                {b: others[k] * _variance(self._variances[k], b) for b in LADDER} for k in keys
            ]
            now = sum(
                _variance(self._variances[k], self.site_bits.get(k, self.initial_width)) * others[k]
                for k in keys
            )
            sizes = [self._structure_numel(k) for k in keys]
            raws = [self._raw_bits.get(k, 32) for k in keys]
            budget = now / (MARGIN * scope_over[scope])
            new = allocate_to_error(sizes, errors, budget, widths, raws)
            floors.update({k: b for k, b in zip(keys, new, strict=True) if b != LADDER[0]})
        tightened = {k for s in scope_over for k in others if within(k.rpartition(":")[0], s)}
        for key in list(floors):
            if key in tightened or key not in self._variances:
                continue
            table, floor = self._variances[key], floors[key]
            module = key.rpartition(":")[0]
            need = max((r for s, r in scope_need.items() if within(module, s)), default=0.0)
            lower = ORDER[max(ORDER.index(floor) - 1, 0)]
            # kept as it is (no error to scale): 8 bits once the scope uses under half
            room = (
                need <= 0.5
                if floor == KEEP
                else _variance(table, lower) * need <= _variance(table, floor)
            )
            if room:
                if lower == LADDER[0]:
                    del floors[key]
                else:
                    floors[key] = lower
        self._floors = floors

    def _structure_numel(self, key: str) -> int:
        readings = self._sens.get(key)
        return int(readings[-1][0]) if readings else 1
