"""The AC-GC policy's corrections of its error model, from measured errors.

κ scales the whole model (measured / modelled total error); λ weights the other ops'
(heuristic) factors and μ_m each weight op's own input, from each module's own gradient
error measured against target · e²‖g_m‖² (see :mod:`lightning_acgc.policies.acgc`).

The bound is held per layer too: a global ‖ĝ − g‖ ≤ e‖g‖ alone lets a layer whose
gradient is small (attention's query and key at initialization) take a 100% error
unnoticed, and with Adam, which rescales every coordinate, it then never learns. A
weight op's own saved input gets at most ``layer_share`` of E·‖g_W‖² (with every class
probed, the probed tensors with it, ``own_share``), divided by a per-layer correction
μ_m; errors that reach a layer through δ (from the other ops' saved tensors) are weighted
by a correction λ. On every verified calibration each
module's own gradient error is measured against target · e²‖g_m‖², ‖g_m‖² the larger of
the step's and the recent calibrations' mean (:meth:`ModelCorrections.layer_scale`: the
scale Adam divides by); a module over it by
r tightens μ_m and λ by r (each the largest of its last ``history`` readings, rising at
most 16x per reading). Modules whose gradient is below ``layer_floor`` of ‖g‖² are not
held to e. The worst module's error is logged as ``layer_grad_error``, the largest λ as
``lambda``; the module whose error used most of its bound (``layer_budget_use``) is
``worst_layer``.

λ is held per scope (a module's parent in the module tree): a module whose error through
δ is over budget tightens the other-ops tensors saved inside its parent (attention's
query and key gradients are made of the attention's own saved tensors — Q, K, the
probabilities — not of the whole model's), and, once that scope's λ has risen
``max_tightening``-fold without effect, its grandparent's too. A tensor's other-ops
factor is weighted by the largest λ of the scopes around its module. A single global λ
ran to 256 on BERT (query/key at 8-10x e) and cost every other tensor its width.
"""

from __future__ import annotations

import math
from collections import deque

from lightning_acgc.policies.acgc_allocation import UNCONSTRAINED
from lightning_acgc.policies.acgc_approach import delta_reading, next_limit
from lightning_acgc.policies.acgc_floors import parent, within
from lightning_acgc.policies.bit_allocation import KEEP

__all__ = ["ModelCorrections"]


class ModelCorrections:
    """Mixin of :class:`~lightning_acgc.policies.acgc.ACGCPolicy`: reads measured errors
    into κ, λ and μ_m, and logs them. Uses the policy's ``codec``, ``target``, ``error_target``,
    ``history``, ``kappa``, ``_readings``, ``_scope_readings``, ``_own_readings``,
    ``_predicted``, ``_predicted_own``, ``_own_ops``, ``_metrics`` and ``own_share``."""

    layer_share = 0.5  # part of each layer's E‖g_W‖² that its weight op's input may use
    max_loosening = 2.0  # largest decrease of κ per reading
    max_tightening = 16.0  # largest increase of λ or μ_m per reading
    min_correction = 1.0  # quant: smallest μ_m (below 1 loosened layers past e: see report)
    layer_floor = 1e-12  # modules with ‖g_m‖² below this share of ‖g‖² are not held to e
    violation_memory = 0.97  # per calibration without a violation, the remembered value fades
    worst_layer: str | None = None  # the module of the last ``layer_budget_use`` reading
    _aim_climbs = 0  # calibrations measured within a rounding floor before a reading

    def __init__(self) -> None:
        super().__init__()
        self._approach: float | None = None  # largest aim/κ of the next allocation (quant)
        self._approach_used: float | None = None  # the aim/κ the settings in force took

    @property
    def aim(self) -> float:
        """The share of the budget an allocation aims at: 1, but ``first_aim`` (``quant``,
        verified) until κ has its first reading, 4x higher after each calibration whose
        error was within the backward's rounding floor (:mod:`~.acgc_rounding`).

        Example:
            >>> from lightning_acgc.policies.acgc import ACGCPolicy
            >>> policy = ACGCPolicy()
            >>> policy.aim == policy.first_aim
            True
            >>> policy._floor_sq = {"net.0": 1.0}  # a 16-bit backward's own noise
            >>> policy._predicted, kappa = 1.0, policy.kappa
            >>> _ = policy._measure(g_sq=1.0, err_sq=0.0)  # within it: no reading
            >>> policy.aim == 4 * policy.first_aim, policy.kappa == kappa
            (True, True)
        """
        if self._readings or not (self.codec == "quant" and self.verify):
            return 1.0
        return min(1.0, self.first_aim * 4.0**self._aim_climbs)

    @property
    def lam(self) -> float:
        """The largest λ over scopes (logged; the ``bounded`` codec's global weight)."""
        return max((max(r, default=1.0) for r in self._scope_readings.values()), default=1.0)

    @property
    def layer_kappa(self) -> float:
        """κ as the per-layer budgets take it: they tighten with it, never loosen. κ is
        the whole model's measured / modelled error; below 1 it says the model reads high
        *on the whole*, mostly from the heuristic factors of the other ops, while a weight
        op's own input is modelled within 0.8-1.2x. Loosened by κ = 0.04 (a CNN with
        probes, 300 steps), its layers measured up to 1.86x their budget and the whole
        1.56e; held, 0.85x and 0.69e. The same reasoning as μ_m's floor of 1."""
        return min(self.kappa, 1.0)

    def _scope_lam(self, scope: str) -> float:
        return max(self._scope_readings.get(scope, ()), default=1.0)

    def tensor_lam(self, key: str) -> float:
        """λ for the tensor saved by site ``key`` ("module:index"): the largest λ of the
        scopes that contain its module (the root scope "" contains every module)."""
        module = key.rpartition(":")[0]
        return max(
            (self._scope_lam(s) for s in self._scope_readings if within(module, s)),
            default=1.0,
        )

    def _own_scale(self, module: str) -> float:
        """μ_m: the extra tightening of weight op ``module``'s own input."""
        return max(self._own_readings.get(module, ()), default=1.0)

    def layer_scale(self, module_g: dict[str, float]) -> dict[str, float]:
        """Each module's ‖g_m‖² as the per-layer promise reads it: the larger of this
        step's (``module_g``) and the mean over the last ``history`` calibrations, this
        one included. Adam divides each coordinate by the running RMS of its gradient:
        an error within e of that RMS moves the update by at most e of a typical one, and
        an error within e of this step's gradient keeps its direction within e. A single
        step's ‖g_m‖ alone swings too much to promise against: an attention key's of the
        BERT recipe moved 10⁴x within 5 steps, the ratio of its rounding error to it
        100x; the char-LM's ``attn.qkv`` fell 4-9x against its load on the steps it broke.

        Example:
            >>> from lightning_acgc.policies.acgc import ACGCPolicy
            >>> policy = ACGCPolicy()
            >>> policy._grad_sq.extend([2.0, 4.0])  # ‖g‖² of two calibrations
            >>> policy._layer_grad_sq.extend([{"a": 0.5, "b": 0.1}, {"a": 0.01, "b": 0.5}])
            >>> policy.layer_scale({"a": 0.04, "b": 2.0})  # a: (0.5·2 + 0.01·4) / 2
            {'a': 0.52, 'b': 2.0}
        """
        pairs = list(zip(reversed(self._layer_grad_sq), reversed(self._grad_sq), strict=False))
        if not pairs:
            return dict(module_g)
        return {
            m: max(g, sum(rel.get(m, 0.0) * total for rel, total in pairs) / len(pairs))
            for m, g in module_g.items()
        }

    def _measure(self, g_sq: float, err_sq: float) -> float:
        """Log the measured error; compare it with the model's prediction for the settings.
        Returns κ's change (new / old; 1 where nothing was predicted)."""
        ratio = math.sqrt(err_sq / g_sq)
        e = self.error_target
        self._metrics["grad_error"] = ratio
        self._metrics["tightened"] = float(ratio > e)
        if self._predicted is None or (self._predicted <= 0 and err_sq > 0):
            return 1.0
        before = self.kappa
        if err_sq <= 0:
            # exactly 0 (what was rounded did not reach the gradient): the model is high by
            # an unknown factor. κ loosens by the most allowed, and no reading is kept (a
            # clamped one held the mean down for ``history`` calibrations, halving κ to 3x
            # under the next readings, and e = 0.01 broke a layer's budget by 1.5x)
            # Within a measured rounding floor (acgc_rounding: a 16-bit backward) the error
            # is under the precision's own noise: the first aim climbs 4x per calibration
            # (κ alone loosened the global budget, never the per-layer ones, which kept the
            # first aim for good: 8 bits where a reading gave 6, 3.5x against 4.3x), then
            # κ loosens 4x. Also where the model predicted none (every tensor kept as it
            # is, as a 16-bit fit's first aim can choose): skipped, κ stayed and so did
            # that allocation.
            if self._floor_sq and self.aim < 1.0:
                self._aim_climbs += 1
            else:
                self.kappa /= self.max_loosening ** (2 if self._floor_sq else 1)
            return self.kappa / before
        reading = max(err_sq / self._predicted, 1e-3)
        self._readings.append(reading)
        if self.codec == "quant":
            # Both ways: the geometric mean of the last readings; at once to the latest
            # reading when the promise was broken.
            mean = math.exp(sum(map(math.log, self._readings)) / len(self._readings))
            mean = max(mean, self.kappa / self.max_loosening)
            self.kappa = max(mean, reading) if ratio > e else mean
        else:
            # Tighten at once; loosen at most 2x in variance per calibration: eb²/3 is a
            # loose upper bound, least reliable far from where it was last checked.
            self.kappa = max(max(self._readings), self.kappa / self.max_loosening)
        return self.kappa / before

    def layer_uses(
        self,
        module_g: dict[str, float],
        module_err: dict[str, float],
        g_sq: float,
        scale: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """Per module held to e (its ‖g_m‖² above ``layer_floor`` of ``g_sq``): its
        measured ‖ĝ_m − g_m‖² over its bound² e_m²·‖g_m‖², ‖g_m‖² as the promise reads
        it (``scale``: :meth:`layer_scale` of ``module_g``, given where already taken).

        Example:
            >>> from lightning_acgc.policies.acgc import ACGCPolicy
            >>> policy = ACGCPolicy(gradient_error=0.5)
            >>> policy.layer_uses({"a": 4.0, "b": 0.0}, {"a": 0.5}, 4.0)  # b: below layer_floor
            {'a': 0.5}
        """
        scale = self.layer_scale(module_g) if scale is None else scale
        return {
            m: module_err.get(m, 0.0) / (self._layer_errors.get(m, self.error_target) ** 2 * g)
            for m, g in scale.items()
            if g > self.layer_floor * g_sq
        }

    def broke_promise(self) -> bool:
        """Whether this step's verified settings measured over e, or a layer over its
        bound: acgc then calibrates again on the next step (up to ``BROKEN_RETRIES`` in a
        row) instead of leaving them in force until the next scheduled calibration.

        Example:
            >>> from lightning_acgc.policies.acgc import ACGCPolicy
            >>> policy = ACGCPolicy(gradient_error=0.05)
            >>> policy._metrics = {"tightened": 0.0, "layer_budget_use": 1.3}
            >>> policy.broke_promise()
            True
        """
        m = self._metrics
        return bool(m.get("tightened")) or m.get("layer_budget_use", 0.0) > 1.0

    def _measure_layers(
        self,
        module_g: dict[str, float],
        module_err: dict[str, float],
        g_sq: float,
        kappa_change: float = 1.0,
    ) -> None:
        """Per-layer check. A module over its budget target · e²‖g_m‖² by a factor r
        tightens, by r, both possible sources: its own input (μ_m, weight ops) and the
        other ops (λ, for the worst module). Each correction is the largest of its last
        ``history`` readings, so it falls back at once where a tightening was not needed,
        and rises at most ``max_tightening`` per reading, so a source that was not the
        cause does not ratchet up."""
        if self.codec == "quant" and self._metrics.get("tightened"):
            self.hold_all_checkpoint_inputs()  # over e: what the error model cannot follow
        worst = step_use = 0.0
        needs: dict[str, float] = {}  # measured error / budget, per module
        through_delta: dict[str, float] = {}  # the part of that not from its own input
        delta_room: dict[str, float] = {}  # that part over what its own input leaves
        share = self.own_share()
        scale = self.layer_scale(module_g)
        uses = self.layer_uses(module_g, module_err, g_sq, scale)
        use = max(uses.values(), default=0.0)
        if use > 0:
            self.worst_layer = max(uses, key=uses.__getitem__)
        for module, g_now in module_g.items():
            if module not in uses:
                continue
            g = scale[module]  # the promise's ‖g_m‖² (layer_scale)
            err = module_err.get(module, 0.0)
            e_m = self._layer_errors.get(module, self.error_target)
            budget = self.target * e_m**2
            if g_now > 0:
                worst = max(worst, err / g_now)
                step_use = max(step_use, err / (e_m**2 * g_now))
            needs[module] = err / (budget * g)
            own = self._predicted_own.get(module, 0.0)
            through_delta[module] = max(err - own, 0.0) / ((1 - share) * budget * g)
            delta_room[module] = delta_reading(err, own, budget * g, share)
        self._metrics["layer_grad_error"] = math.sqrt(worst)
        self._metrics["layer_budget_use"] = math.sqrt(use)  # ‖ĝ_m − g_m‖ / (e_m·layer_scale)
        self._metrics["layer_step_use"] = math.sqrt(step_use)  # the same against this ‖g_m‖
        if self._predicted is None or not needs:
            return  # the settings in force were not allocated this step (first step)
        if self.codec == "quant":
            # how far the next allocation may loosen: the errors through δ (acgc_approach)
            self._approach = next_limit(self._approach_used, delta_room)
            # κ has just tightened every budget of the next allocation by 1/change
            # (``kappa_change``, from :meth:`_measure`): what is left for the per-layer
            # corrections is each module's miss beyond the whole model's (counting it
            # twice put a quarter of ResNet-50's bytes at 32 bits)
            change = max(kappa_change, 1.0)
            needs = {m: r / change for m, r in needs.items()}
            through_delta = {m: r / change for m, r in through_delta.items()}
        # Per scope: the δ part of its over-budget modules (one whose own input explains
        # its error lets λ fall), else the room its modules leave.
        over: dict[str, float] = {}
        room: dict[str, float] = {}
        for module, r in needs.items():
            scope = parent(module)
            if r > 1 and self.codec == "bounded":
                over[scope] = max(over.get(scope, 0.0), through_delta[module])
                if scope and self._scope_lam(scope) >= self.max_tightening:
                    # tightened 16x here without effect: the cause is further out
                    outer = parent(scope)
                    over[outer] = max(over.get(outer, 0.0), through_delta[module])
            elif r <= 1:
                room[scope] = max(room.get(scope, 0.0), r)
        scope_need = {**room, **over}
        if self.codec == "quant":
            self._update_floors(needs, through_delta)
        for scope in {*self._scope_readings, *scope_need}:
            readings = self._scope_readings.setdefault(scope, deque(maxlen=self.history))
            self._add_reading(readings, scope_need.get(scope, 0.0), 1.0, f"scope:{scope}")
        floor = 1.0 if self.codec == "bounded" else self.min_correction
        for module in self._own_ops:
            readings = self._own_readings.setdefault(module, deque(maxlen=self.history))
            need = needs.get(module, 0.0)
            if self.codec == "quant" and through_delta.get(module, 0.0) > 1:
                need = min(need, 1.0)  # δ's part is over: the floors take it, μ_m holds
            self._add_reading(readings, need, floor, module)

    def _add_reading(self, readings: deque[float], need: float, floor: float, key: str) -> None:
        """One reading of a per-layer correction (the largest of its ``readings``): the
        value times ``need`` would have put the layer on budget; kept within
        [max(floor, value / max_loosening), value · max_tightening], and above
        ``max_loosening`` times the largest value under which this correction's layer
        (``key``; "scope:<scope>" for λ) broke its budget (a memory that fades by
        ``violation_memory`` per calibration within budget). Falling at once made λ
        oscillate: back within e it dropped 16x, one site fell from 8 to 4 bits and the
        next calibration broke the promise by 16x. λ's floor is 1 (κ scales the whole model both
        ways); with ``quant`` μ_m's is ``min_correction``, so a layer the model overrates
        (its own input's error is modelled exactly, up to δ's correlations) loosens too."""
        value = max(readings, default=1.0)
        # A value under which the layer broke its budget is not tried again soon (widths
        # are discrete: 2x looser can mean 8 -> 4 bits, 289x the error).
        violated = self._violated
        if need > 1:
            violated[key] = max(violated.get(key, 0.0), value)
        elif key in violated:
            violated[key] *= self.violation_memory
        low = max(floor, value / self.max_loosening, self.max_loosening * violated.get(key, 0.0))
        readings.append(min(max(value * need, low), max(value * self.max_tightening, low)))

    def _log(self) -> None:
        m = self._metrics
        m["calib_ms"] = 1e3 * self._calib_s
        if self._step_s:
            m["calib_share"] = self._calib_s / (self.calibrate_every * self._step_s)
        m["kappa"], m["lambda"] = self.kappa, self.lam
        m["error_target"] = self.error_target
        if self.codec == "quant" and self._structure:
            split = self.site_split
            structure = self._structure  # this step's sites (a site may not recur)
            widths = [
                (structure[k], b - split.get(k, 0))
                for k, b in self.site_bits.items()
                if k in structure
            ]
            sized = [(math.prod(r.shape), 32 if b == KEEP else b) for r, b in widths if r.shape]
            if sized:
                m["avg_bits"] = sum(n * b for n, b in sized) / sum(n for n, _ in sized)
            m["floors"] = float(len(self._floors))
        finite = [math.log10(b) for b in self.bounds.values() if b < UNCONSTRAINED]
        if finite:
            m["log10_bound"] = sum(finite) / len(finite)
