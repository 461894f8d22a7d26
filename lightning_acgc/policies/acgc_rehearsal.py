"""acgc's rehearsals: the calibration's settings tried on its own batch before they train.

On a verified calibration the settings of the step are allocated from that step's
statistics, with corrections (κ, λ, μ_m, the probes' factors) learned on earlier
calibrations. What reaches a layer through δ moves several-fold between calibrations, so
a correction learned on the last one can be off on this one: aimed with no margin
(``target=1``), the per-layer promise broke on 54 of the sweep's 282 calibrations.

A rehearsal is one more compressed forward and backward of the same batch (random state
and buffers restored), with the settings just allocated, measured against the exact
gradient the calibration already holds. Where it keeps the promise (globally within
``rehearsal_guard``·e, each layer within ``rehearsal_guard`` of its bound, the larger of
its step's and its recent ‖g_m‖ as :meth:`~.acgc_corrections.ModelCorrections.layer_scale`
reads it) nothing changes and the step's own pass follows. Where it does not, the
reading corrects the model as a calibration's would (κ, λ, μ_m, the floors) and the
settings are allocated again; up to ``rehearsals`` passes per calibration (the last
allocation stands). Off by default (``rehearsals=0``); a pass costs about one step.
"""

from __future__ import annotations

import math

import torch

from lightning_acgc.policies._acgc_stats import per_module_sq_diff
from lightning_acgc.policies._schedule import check_int
from lightning_acgc.policies.acgc_floors import ORDER, parent, within
from lightning_acgc.policies.bit_allocation import KEEP, LADDER

__all__ = ["Rehearsals"]


class Rehearsals:
    """Mixin of :class:`~lightning_acgc.policies.acgc.ACGCPolicy`: rehearsal passes on
    calibration steps. Uses the policy's ``codec``, ``verify``, ``error_target``,
    ``layer_floor``, ``_calibrating``, ``_exact``, ``_exact_sq``, ``_predicted``,
    ``_layer_errors``, ``_calib_s``, ``_lap``, ``layer_scale``, ``_measure``,
    ``_measure_layers`` and ``settle``.

    Example:
        >>> from lightning_acgc.policies.acgc import ACGCPolicy
        >>> policy = ACGCPolicy(rehearsals=2)
        >>> policy.rehearsals, policy.wants_rehearsal()  # nothing allocated yet
        (2, False)
    """

    rehearsals = 0  # passes per calibration at most (``rehearsals=``)
    rehearsal_guard = 0.9  # a rehearsal keeps the promise within this share of each bound

    def __init__(self) -> None:
        super().__init__()
        self._rehearsed = 0  # rehearsal passes this calibration
        self._rehearsal_floors: dict[str, int] = {}  # this calibration's, per tensor

    def begin_step(self, step: int) -> None:
        super().begin_step(step)  # type: ignore[misc]
        self._rehearsed = 0
        if self._calibrating:
            self._rehearsal_floors = {}  # a calibration's floors hold until the next

    def floors(self) -> dict[str, int]:
        """The floors of the other corrections, raised to this calibration's rehearsal
        floors."""
        floors = super().floors()  # type: ignore[misc]
        for key, width in self._rehearsal_floors.items():
            floors[key] = max(floors.get(key, LADDER[0]), width, key=ORDER.index)
        return floors

    def set_rehearsals(self, rehearsals: int | None) -> None:
        """The ``rehearsals`` option (None: the class's default).

        Raises:
            ValueError: not an integer >= 0.
        """
        if rehearsals is not None:
            check_int("rehearsals", rehearsals, 0)
            self.rehearsals = rehearsals

    def wants_rehearsal(self) -> bool:
        """Whether the step begun wants (another) rehearsal pass: a verified ``quant``
        calibration whose settings were allocated this step, fewer than ``rehearsals``
        passes run."""
        return (
            self.codec == "quant"
            and self.verify
            and self._calibrating
            and self._exact is not None
            and self._predicted is not None
            and self._rehearsed < self.rehearsals
        )

    def end_rehearsal(self, grads: dict[str, torch.Tensor] | None) -> bool:
        """Read a rehearsal pass's gradient ``grads`` (averaged over ranks) against the
        exact one. Where it broke the guarded promise: the model corrected, the settings
        allocated again, and True (another pass may check them)."""
        self._rehearsed += 1
        self._calib_s += self._lap()  # the pass
        if grads is None or self._exact is None:
            return False
        module_g = self._exact_sq or {}
        module_err = per_module_sq_diff(grads, self._exact)
        g_sq, err_sq = sum(module_g.values()), sum(module_err.values())
        if g_sq <= 0 or not math.isfinite(err_sq):
            return False
        uses = self._rehearsal_uses(module_g, module_err, g_sq, err_sq)
        if self._rehearsed == 1:  # the settings as first allocated: logged as read
            self._metrics["rehearsal_error"] = math.sqrt(err_sq / g_sq)
            layers = [u for m, u in uses.items() if m]
            self._metrics["rehearsal_layer_use"] = math.sqrt(max(layers, default=0.0))
        self._metrics["rehearsals"] = float(self._rehearsed)
        guard_sq = self.rehearsal_guard**2
        over = {m: u / guard_sq for m, u in uses.items() if u > guard_sq}
        if not over:
            return False
        metrics = dict(self._metrics)  # the step's own pass logs its reading
        change = self._measure(g_sq, err_sq)
        self._measure_layers(module_g, module_err, g_sq, change)
        self._metrics = {**metrics, "rehearsal_fixes": metrics.get("rehearsal_fixes", 0.0) + 1}
        raised = self._raise_floors(over)
        self.settle()
        self._calib_s += self._lap()
        return raised

    def _rehearsal_uses(
        self, module_g: dict[str, float], module_err: dict[str, float], g_sq: float, err_sq: float
    ) -> dict[str, float]:
        """Per module held to e, its error² over its bound² (``""``: the whole model's),
        the bound against :meth:`layer_scale` as the promise reads it."""
        uses = {"": err_sq / (self.error_target**2 * g_sq)}
        scale = self.layer_scale(module_g)
        for module, g in scale.items():
            if g > self.layer_floor * g_sq:
                e_m = self._layer_errors.get(module, self.error_target)
                uses[module] = module_err.get(module, 0.0) / (e_m**2 * g)
        return uses

    def _raise_floors(self, over: dict[str, float]) -> bool:
        """Floors for this calibration on the tensors that reach each module in ``over``
        (its error² over the guarded bound²)
        (a weight op's saved input, a probed tensor, an other-ops tensor saved inside the
        module's parent; every tensor for the whole model): their width in force raised
        by one step per 4x of the module's excess (a step is ~4x the rounding variance).
        Whether any width rose."""
        sens = self.probed_all({k: v[-1] for k, v in self._sens.items()})  # type: ignore[attr-defined]
        raised = False
        for key, (_, weights, other) in sens.items():
            if key not in self._variances:  # type: ignore[attr-defined]
                continue
            module = key.rpartition(":")[0]
            excess = max(
                (
                    r
                    for m, r in over.items()
                    if not m or m in weights or (other > 0 and within(module, parent(m)))
                ),
                default=0.0,
            )
            now = max(
                self.site_bits.get(key, self.initial_width),  # type: ignore[attr-defined]
                self._rehearsal_floors.get(key, LADDER[0]),
                key=ORDER.index,
            )
            if excess <= 1 or now == KEEP:
                continue
            steps = max(1, math.ceil(math.log(excess) / math.log(4)))
            width = ORDER[min(ORDER.index(now) + steps, len(ORDER) - 1)]
            if width != now:
                self._rehearsal_floors[key] = width
                raised = True
        return raised
