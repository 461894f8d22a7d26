"""``acgc``: per-tensor codec settings from an allowed relative gradient error (AC-GC).

The user states ``gradient_error`` e: the compressed gradient ĝ should satisfy
E‖ĝ − g‖² ≤ e²‖g‖². On calibration steps the policy reads each module's output-gradient
norm (cheap tensor hooks, no second forward) and the parameter-gradient norm, turns them
into each saved tensor's sensitivity c_t (:mod:`lightning_acgc.policies.error_model`:
an error of variance σ² per element adds c_t·σ² to ‖Δg‖²) and chooses each tensor's
codec setting (:mod:`lightning_acgc.policies.acgc_allocation`) so that the modelled
error stays within E = target · e² · ‖g‖² / κ:

* ``codec="quant"`` (default): unbiased stochastic rounding with a width per tensor from
  {1, 2, 4, 8} bits (or kept as it is). Its error per element at each width,
  v_t(b), is measured exactly on calibration steps
  (:func:`~lightning_acgc.policies.quant_error.sr_variance`); each tensor starts at the
  smallest width its weight ops' own budgets allow, then greedy upgrades (best error
  reduction per added bit) bring Σ c_t·v_t(b_t) within E. Unbiased errors average out
  over a weight op's fan-in; that is why this beats error-bounded rounding at equal
  gradient error (issue 13: 2-bit quant at 14x has the error `bounded` reaches at 7x).
* ``codec="bounded"``: COMET-style |x − x̂| ≤ eb (variance ≤ eb²/3), each tensor's share
  of E in proportion to its size (the previous default; its calibration is unchanged).

The bound is held per layer too: a global ‖ĝ − g‖ ≤ e‖g‖ alone lets a layer whose
gradient is small (attention's query and key at initialization) take a 100% error
unnoticed, and with Adam, which rescales every coordinate, it then never learns. A
weight op's own saved input gets at most ``layer_share`` of E·‖g_W‖², divided by a
per-layer correction μ_m; errors that reach a layer through δ (from the other ops'
saved tensors) are weighted by a correction λ. On every verified calibration each
module's own gradient error is measured against target · e²‖g_m‖²; a module over it by
r tightens μ_m and λ by r (each the largest of its last ``history`` readings, rising at
most 16x per reading). Modules whose gradient is below ``layer_floor`` of ‖g‖² are not
held to e. The worst module's error is logged as ``layer_grad_error``, λ as ``lambda``.

Verify, don't trust: with ``verify=True`` the exact gradient is computed on calibration
steps; its statistics set the settings of the same step's compressed pass, so the logged
``grad_error`` = ‖ĝ − g‖/‖g‖ measures the settings in force. κ is the ratio of measured
to modelled error. With ``quant`` it follows the readings both ways (the geometric mean
of the last ``history``, aiming the measured error at √target · e ≈ 0.6e; it falls at
most 2x per reading, as the model's error differs between widths) and jumps at once to
the latest reading when a measurement exceeds e. With ``bounded`` it tightens at once
and loosens at most 2x per calibration (its eb²/3 is a loose upper bound). A measurement
above e is logged as ``tightened`` = 1. With ``verify=False`` the compressed pass's
statistics set the following steps' settings and κ keeps its value.

Noise-relative budget (``noise_ratio`` ρ): compression may add at most ρ² of the batch
gradient's sampling variance. On calibration steps the adapter computes the exact
gradients g1, g2 of the batch's two halves (:meth:`ACGCPolicy.set_noise_gradients`,
before :meth:`set_exact_gradients`); Var(g) ≈ ‖g1 − g2‖²/4, so the allowed relative
error is e_noise = ρ·‖g1 − g2‖/(2‖g‖) (both averaged over the last ``history``
readings). With ``gradient_error`` also given, the smaller of the two holds; with
``noise_ratio`` alone, e_noise (at most ``max_error``). Logged as ``error_target``.

Cost (``calib_ms``): the extra passes (exact, halves) and the policy's own statistics on a
calibration step, host time; ``calib_share``: that over ``calibrate_every`` ordinary
steps (timed between :meth:`begin_step` and :meth:`end_step`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from typing import Any

import torch
from torch import nn

from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.registry import codec_config_class
from lightning_acgc.config import CompressionConfig
from lightning_acgc.engine.meter import SiteRecord
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies._acgc_stats import diff_sq, module_norms, per_module_sq, reduce_tables
from lightning_acgc.policies._schedule import check_int
from lightning_acgc.policies.acgc_allocation import (
    UNCONSTRAINED,
    average,
    bounded_bounds,
    quant_widths,
)
from lightning_acgc.policies.base import Reduce
from lightning_acgc.policies.bit_allocation import KEEP, LADDER
from lightning_acgc.policies.calibrating import CalibratingPolicy
from lightning_acgc.policies.error_model import NORM_TYPES, tensor_sensitivities
from lightning_acgc.policies.quant_error import sr_variance

__all__ = ["ACGCPolicy"]

CODECS = ("quant", "bounded")


def _quant_meta_options() -> dict[str, Any]:
    """bf16 group metadata (32 bits a group instead of 64) where this version's ``quant``
    codec offers it; read from its config at runtime so acgc works with either."""
    fields = {f.name for f in dataclasses.fields(codec_config_class("quant"))}
    return {"meta": "bf16"} if "meta" in fields else {}


class ACGCPolicy(CalibratingPolicy):
    """Compression settings per saved tensor derived from an allowed gradient error.

    Args:
        gradient_error: allowed relative gradient error e (0 < e < 1); default 0.05, or
            none when ``noise_ratio`` is given alone.
        calibrate_every: steps between calibrations (after the first ``warmup_steps``).
        verify: compute the exact gradient on calibration steps, log the measured error
            and correct the model with it.
        warmup_steps: the first steps of fit all calibrate.
        history: calibrations averaged (AC-GC averages its last readings).
        initial_relative_bound: ``bounded`` only: bound relative to each tensor's range
            before the first calibration and for sites never seen.
        group_size: values per group of the codec.
        target: fraction of e² the modelled error aims at (0.35: measured errors near 0.6e).
        codec: ``"quant"`` (per-tensor bit widths, stochastic rounding) or ``"bounded"``.
        layer_floor: modules whose squared gradient is below this share of ‖g‖² are
            held to e only through the global error (default: ``layer_floor``, 1e-12).
        noise_ratio: ρ > 0: compression adds at most ρ² of the batch gradient's sampling
            variance (needs the adapter to pass the batch halves' gradients).
        config: engine settings (backend, min_numel, seed); its codec is ignored.

    Example:
        >>> policy = ACGCPolicy(gradient_error=0.05, calibrate_every=50)
        >>> policy.needs_exact_gradient(0), policy.needs_exact_gradient(7)
        (True, False)
        >>> ACGCPolicy(noise_ratio=0.2).needs_noise_estimate(0)
        True
    """

    name = "acgc"
    default_codec = "quant"
    initial_width = 8  # quant: width before the first calibration and for unseen sites
    layer_share = 0.5  # part of each layer's E‖g_W‖² that its weight op's input may use
    max_loosening = 2.0  # largest decrease of κ per reading
    max_tightening = 16.0  # largest increase of λ or μ_m per reading
    min_correction = 1 / 64  # quant: smallest μ_m (a layer the model overrates)
    layer_floor = 1e-12  # modules with ‖g_m‖² below this share of ‖g‖² are not held to e
    max_error = 0.9  # the largest relative error a noise-relative budget allows

    def __init__(
        self,
        gradient_error: float | None = None,
        calibrate_every: int = 100,
        verify: bool = True,
        warmup_steps: int = 3,
        history: int = 3,
        initial_relative_bound: float = 1e-3,
        group_size: int = 256,
        target: float | None = None,
        codec: str = "quant",
        noise_ratio: float | None = None,
        layer_floor: float | None = None,
        config: CompressionConfig | None = None,
    ) -> None:
        if gradient_error is None and noise_ratio is None:
            gradient_error = 0.05
        if gradient_error is not None and (
            isinstance(gradient_error, bool)
            or not (isinstance(gradient_error, (int, float)) and 0 < gradient_error < 1)
        ):
            raise ValueError(f"gradient_error={gradient_error!r} must be a number in (0, 1)")
        if noise_ratio is not None and (
            isinstance(noise_ratio, bool)
            or not (isinstance(noise_ratio, (int, float)) and noise_ratio > 0)
        ):
            raise ValueError(f"noise_ratio={noise_ratio!r} must be a number > 0 or None")
        if codec not in CODECS:
            raise ValueError(f"codec={codec!r} is not supported by acgc; allowed: {CODECS}")
        check_int("calibrate_every", calibrate_every, 1)
        check_int("warmup_steps", warmup_steps, 1)
        check_int("history", history, 1)
        if not 0 < initial_relative_bound < 1:
            raise ValueError(f"initial_relative_bound={initial_relative_bound!r} must be in (0, 1)")
        target = target if target is not None else 0.35
        if not 0 < target <= 1:
            raise ValueError(f"target={target!r} must be in (0, 1]")
        self.gradient_error = None if gradient_error is None else float(gradient_error)
        self.noise_ratio = None if noise_ratio is None else float(noise_ratio)
        self.calibrate_every = calibrate_every
        self.verify = verify
        self.warmup_steps = warmup_steps
        self.history = history
        self.initial_relative_bound = initial_relative_bound
        self.group_size = group_size
        self.target = target
        self.codec = codec
        if layer_floor is not None:
            if not 0 <= layer_floor <= 1:
                raise ValueError(f"layer_floor={layer_floor!r} must be in [0, 1]")
            self.layer_floor = float(layer_floor)
        self.config = config or CompressionConfig(codec=codec)
        super().__init__()
        self._meta = _quant_meta_options() if codec == "quant" else {}
        self.bounds: dict[str, float] = {}
        self.site_bits: dict[str, int] = {}
        self.kappa = 0.5 if codec == "quant" else 4.0
        self._readings: deque[float] = deque(maxlen=history)
        self._layer_readings: deque[float] = deque(maxlen=history)  # λ's
        self._own_readings: dict[str, deque[float]] = {}  # μ_m's, by weight op
        self._predicted_own: dict[str, float] = {}  # per weight op, for the settings in force
        # per tensor: (numel, {weight op: fan_in·‖δ‖²}, other ops' factor) per calibration
        self._sens: dict[str, deque[tuple[int, dict[str, float], float]]] = {}
        self._grad_sq: deque[float] = deque(maxlen=history)
        self._noise_sq: deque[float] = deque(maxlen=history)
        self._layer_grad_sq: deque[dict[str, float]] = deque(maxlen=history)
        self._structure: dict[str, SiteRecord] = {}
        self._norm_params: list[str] = []
        self._inv_var: dict[str, float] = {}
        self._variances: dict[str, list[float]] = {}  # quant: v_t(b) per width of LADDER
        self._pending_var: dict[str, torch.Tensor] = {}
        self._raw_bits: dict[str, int] = {}
        self._predicted: float | None = None
        self._exact: dict[str, torch.Tensor] | None = None
        self._pending_noise: float | None = None
        self.error_target = self.gradient_error or self.max_error
        self._mark = 0.0  # time of the last calibration event
        self._calib_s = 0.0
        self._step_s: float | None = None  # an ordinary step's time (between the hooks)

    # -- codecs ---------------------------------------------------------------
    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        if self._calibrating:
            start = time.perf_counter()
            if site.module_type in NORM_TYPES:
                var = float(x.detach().float().var())
                if var > 0 and math.isfinite(var):
                    self._inv_var[site.key] = 1.0 / var
            if self.codec == "quant":
                self._pending_var[site.key] = sr_variance(x, self.group_size)
                self._raw_bits[site.key] = 8 * x.element_size()
            self._calib_s += time.perf_counter() - start
        if self.codec == "bounded":
            return self._bounded_for(site.key, self.bounds, self.initial_relative_bound)
        bits = self.site_bits.get(site.key, self.initial_width)
        if bits == KEEP:
            return None
        return self._codec("quant", bits=bits, group_size=self.group_size, **self._meta)

    # -- calibration cycle ------------------------------------------------------
    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self._exact = None
        self._predicted = None
        self._pending_noise = None
        self._pending_var = {}
        self._calib_s = 0.0
        self._begin = self._mark = time.perf_counter()

    def needs_exact_gradient(self, step: int) -> bool:
        return self.verify and self.is_calibration_step(step)

    def needs_noise_estimate(self, step: int) -> bool:
        """Whether the adapter should pass the gradients of the batch's two halves."""
        return self.noise_ratio is not None and self.is_calibration_step(step)

    def _lap(self) -> float:
        """Seconds since the last calibration event (an extra pass just ran)."""
        now = time.perf_counter()
        elapsed, self._mark = now - self._mark, now
        return elapsed

    def set_noise_gradients(
        self,
        first: dict[str, torch.Tensor],
        second: dict[str, torch.Tensor],
        reduce: Reduce | None = None,
    ) -> None:
        """The exact gradients (by parameter name) of the two halves of this step's batch,
        each the loss's mean over its half; call before :meth:`set_exact_gradients`."""
        self._calib_s += self._lap()
        (table,) = reduce_tables(reduce, {"": diff_sq(first, second)})
        self._pending_noise = table[""]
        self._calib_s += self._lap()

    def set_exact_gradients(
        self, grads: dict[str, torch.Tensor], reduce: Reduce | None = None
    ) -> None:
        """Statistics of the exact pass set the settings of this step's compressed pass."""
        self._calib_s += self._lap()
        self._exact = {k: g.detach() for k, g in grads.items() if g is not None}
        if self._calibrating:
            grad_sq = self.stats.stop()
            module_sq = per_module_sq(self._exact)
            layer = self._weight_ops(module_sq)
            grad_sq, layer, g_sq = reduce_tables(
                reduce, grad_sq, layer, {"": sum(module_sq.values())}
            )
            if self._structure:
                self._calibrate(grad_sq, g_sq[""], layer)
            elif self.noise_ratio is not None:
                self._update_target(g_sq[""])
        self._calib_s += self._lap()

    def end_step(self, step: int, model: nn.Module, reduce: Reduce) -> None:
        if not self._calibrating:
            elapsed = time.perf_counter() - self._begin
            self._step_s = elapsed if self._step_s is None else 0.8 * self._step_s + 0.2 * elapsed
            return
        self._calibrating = False
        self._mark = time.perf_counter()
        grad_sq = self.stats.stop()
        module_g, module_err = module_norms(model, self._exact)
        variances = {k: v.tolist() for k, v in self._pending_var.items()}
        flat = {f"{k}\0{i}": x for k, v in variances.items() for i, x in enumerate(v)}
        grad_sq, module_g, module_err, flat = reduce_tables(
            reduce, grad_sq, module_g, module_err, flat
        )
        for k in variances:
            self._variances[k] = [flat[f"{k}\0{i}"] for i in range(len(LADDER))]
        g_sq, err_sq = sum(module_g.values()), sum(module_err.values())
        if self.engine is not None:
            self._structure = {
                k: dataclasses.replace(r) for k, r in self.engine.stats.sites.items()
            }
        if self._exact is not None and g_sq > 0:
            self._measure(g_sq, err_sq)
            self._measure_layers(module_g, module_err, g_sq)
        elif self._exact is None and g_sq > 0:
            # cheap mode: settings for the next steps (module_g is the compressed gradient's)
            self._calibrate(grad_sq, g_sq, self._weight_ops(module_g))
        self._calib_s += self._lap()
        self._log()

    def _log(self) -> None:
        m = self._metrics
        m["calib_ms"] = 1e3 * self._calib_s
        if self._step_s:
            m["calib_share"] = self._calib_s / (self.calibrate_every * self._step_s)
        m["kappa"], m["lambda"] = self.kappa, self.lam
        m["error_target"] = self.error_target
        if self.codec == "quant" and self._structure:
            widths = [(self._structure[k], b) for k, b in self.site_bits.items()]
            sized = [(math.prod(r.shape), 32 if b == KEEP else b) for r, b in widths if r.shape]
            if sized:
                m["avg_bits"] = sum(n * b for n, b in sized) / sum(n for n, _ in sized)
        finite = [math.log10(b) for b in self.bounds.values() if b < UNCONSTRAINED]
        if finite:
            m["log10_bound"] = sum(finite) / len(finite)

    @property
    def lam(self) -> float:
        """λ: the extra weight of the other ops' errors, from per-layer readings."""
        return max(self._layer_readings, default=1.0)

    def _own_scale(self, module: str) -> float:
        """μ_m: the extra tightening of weight op ``module``'s own input."""
        return max(self._own_readings.get(module, ()), default=1.0)

    def _weight_ops(self, module_sq: dict[str, float]) -> dict[str, float]:
        """‖g_W‖² per weight op (its weight and bias) from the per-module table."""
        return {m: module_sq.get(m, 0.0) for m in self._own_ops}

    @property
    def _own_ops(self) -> list[str]:
        """Modules whose gradient sees a saved input directly: weight ops, affine norms."""
        return [*self.stats.fan_in, *self._norm_params]

    def setup(self, model: nn.Module) -> None:
        super().setup(model)
        self._norm_params = [
            n
            for n, m in model.named_modules()
            if type(m).__name__ in NORM_TYPES and getattr(m, "weight", None) is not None
        ]

    def _update_target(self, g_sq: float) -> None:
        """This calibration's allowed error e: ``gradient_error`` and/or the noise budget."""
        self._grad_sq.append(g_sq)
        if self.noise_ratio is None:
            return
        if self._pending_noise is not None:
            self._noise_sq.append(self._pending_noise)
            self._pending_noise = None
        if not self._noise_sq:
            return
        mean_g = sum(self._grad_sq) / len(self._grad_sq)
        noise = sum(self._noise_sq) / len(self._noise_sq)
        e_noise = self.noise_ratio * math.sqrt(noise / 4 / mean_g) if mean_g > 0 else 0.0
        self._metrics["noise_error"] = e_noise
        self.error_target = min(e_noise, self.gradient_error or self.max_error, self.max_error)

    def _measure(self, g_sq: float, err_sq: float) -> None:
        """Log the measured error; compare it with the model's prediction for the settings."""
        ratio = math.sqrt(err_sq / g_sq)
        e = self.error_target
        self._metrics["grad_error"] = ratio
        self._metrics["tightened"] = float(ratio > e)
        if self._predicted is None or self._predicted <= 0:
            return
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

    def _measure_layers(
        self, module_g: dict[str, float], module_err: dict[str, float], g_sq: float
    ) -> None:
        """Per-layer check. A module over its budget target · e²‖g_m‖² by a factor r
        tightens, by r, both possible sources: its own input (μ_m, weight ops) and the
        other ops (λ, for the worst module). Each correction is the largest of its last
        ``history`` readings, so it falls back at once where a tightening was not needed,
        and rises at most ``max_tightening`` per reading, so a source that was not the
        cause does not ratchet up."""
        budget = self.target * self.error_target**2
        worst = 0.0
        needs: dict[str, float] = {}  # measured error / budget, per module
        through_delta: dict[str, float] = {}  # the part of that not from its own input
        for module, g in module_g.items():
            if g <= self.layer_floor * g_sq:
                continue
            err = module_err.get(module, 0.0)
            worst = max(worst, err / g)
            needs[module] = err / (budget * g)
            own = self._predicted_own.get(module, 0.0)
            through_delta[module] = max(err - own, 0.0) / ((1 - self.layer_share) * budget * g)
        self._metrics["layer_grad_error"] = math.sqrt(worst)
        if self._predicted is None or not needs:
            return  # the settings in force were not allocated this step (first step)
        # Modules over budget set λ by their δ part (an over-budget module whose own input
        # explains its error lets λ fall); with all within budget λ may fall to what the
        # worst module leaves room for.
        over = [through_delta[m] for m, r in needs.items() if r > 1]
        lam_need = max(over) if over else max(needs.values())
        self._add_reading(self._layer_readings, lam_need, 1.0)
        floor = 1.0 if self.codec == "bounded" else self.min_correction
        for module in self._own_ops:
            readings = self._own_readings.setdefault(module, deque(maxlen=self.history))
            self._add_reading(readings, needs.get(module, 0.0), floor)

    def _add_reading(self, readings: deque[float], need: float, floor: float) -> None:
        """One reading of a per-layer correction (the largest of its ``readings``): the
        value times ``need`` would have put the layer on budget; kept within
        [floor, value · max_tightening]. λ's floor is 1 (κ scales the whole model both
        ways); with ``quant`` μ_m's is ``min_correction``, so a layer the model overrates
        (its own input's error is modelled exactly, up to δ's correlations) loosens too."""
        value = max(readings, default=1.0)
        readings.append(min(max(value * need, floor), value * self.max_tightening))

    def _calibrate(self, grad_sq: dict[str, float], g_sq: float, layer: dict[str, float]) -> None:
        sens = tensor_sensitivities(
            self._structure, grad_sq, self.stats.fan_in, self._inv_var, self._norm_params
        )
        for key, s in sens.items():
            self._sens.setdefault(key, deque(maxlen=self.history)).append(
                (s.numel, dict(s.weight_by_module), s.other)
            )
        self._update_target(g_sq)
        self._layer_grad_sq.append(layer)
        self._allocate()
        variance = {k: self._variance(k) for k in sens}
        in_force = {k: s for k, s in sens.items() if variance[k] > 0}
        # the model's own total (λ and μ_m only shift the allocation; κ scales the model)
        self._predicted = sum(s.total * variance[k] for k, s in in_force.items())
        own: dict[str, float] = {}  # per weight op: the modelled error from its own input
        for k, s in in_force.items():
            for m, c in s.weight_by_module.items():
                own[m] = own.get(m, 0.0) + c * variance[k]
        self._predicted_own = own

    def _variance(self, key: str) -> float:
        """Modelled error variance per element of tensor ``key`` under the settings."""
        if self.codec == "bounded":
            bound = self.bounds.get(key, UNCONSTRAINED)
            return bound**2 / 3 if bound < UNCONSTRAINED else 0.0
        width = self.site_bits.get(key, self.initial_width)
        table = self._variances.get(key)
        return 0.0 if width == KEEP or table is None else table[LADDER.index(width)]

    def _allocate(self) -> None:
        e_sq = self.error_target**2 * self.target / self.kappa
        g_sq = sum(self._grad_sq) / len(self._grad_sq)
        layer_sq: dict[str, float] = {}
        for reading in self._layer_grad_sq:
            for m, v in reading.items():
                layer_sq[m] = layer_sq.get(m, 0.0) + v / len(self._layer_grad_sq)
        # modules not held to e themselves (below layer_floor) join the global budget
        floor = self.layer_floor * g_sq
        layer_sq = {m: v if v > floor else 0.0 for m, v in layer_sq.items()}
        sens = average(self._sens)
        args = (layer_sq, g_sq, e_sq, self.lam, self._own_scale, self.layer_share)
        if self.codec == "bounded":
            self.bounds = bounded_bounds(sens, *args)
            return
        meta_bits = 32 if self._meta.get("meta") == "bf16" else 64
        widths = quant_widths(
            sens, self._variances, *args, self._raw_bits, meta_bits / self.group_size
        )
        self.site_bits = {**self.site_bits, **widths}

    # -- reporting and state ---------------------------------------------------
    def site_settings(self) -> dict[str, str]:
        if self.codec == "bounded":
            return {k: f"eb={b:.3g}" for k, b in sorted(self.bounds.items())}
        return {k: "kept" if b == KEEP else f"bits={b}" for k, b in sorted(self.site_bits.items())}

    def describe(self, codec: Codec) -> str:
        if codec.name == "quant":
            return f"bits={codec.config.bits}"
        return super().describe(codec)

    def state_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "bounds": dict(self.bounds),
            "site_bits": dict(self.site_bits),
            "variances": {k: list(v) for k, v in self._variances.items()},
            "raw_bits": dict(self._raw_bits),
            "kappa": self.kappa,
            "error_target": self.error_target,
            "readings": list(self._readings),
            "layer_readings": list(self._layer_readings),
            "own_readings": {m: list(v) for m, v in self._own_readings.items()},
            "sens": {k: list(v) for k, v in self._sens.items()},
            "grad_sq": list(self._grad_sq),
            "noise_sq": list(self._noise_sq),
            "layer_grad_sq": list(self._layer_grad_sq),
            "inv_var": dict(self._inv_var),
            "structure": {k: dataclasses.asdict(r) for k, r in self._structure.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (checkpoints written before the quant codec or the per-layer check lack some)
        self.bounds = dict(state["bounds"])
        self.site_bits = {k: int(v) for k, v in state.get("site_bits", {}).items()}
        self._variances = {k: list(v) for k, v in state.get("variances", {}).items()}
        self._raw_bits = dict(state.get("raw_bits", {}))
        self.kappa = float(state["kappa"])
        self.error_target = float(state.get("error_target", self.error_target))
        self._readings = deque(state["readings"], maxlen=self.history)
        self._layer_readings = deque(state.get("layer_readings", ()), maxlen=self.history)
        self._own_readings = {
            m: deque(v, maxlen=self.history) for m, v in state.get("own_readings", {}).items()
        }
        self._sens = {
            k: deque((tuple(h) for h in v), maxlen=self.history) for k, v in state["sens"].items()
        }
        self._grad_sq = deque(state["grad_sq"], maxlen=self.history)
        self._noise_sq = deque(state.get("noise_sq", ()), maxlen=self.history)
        self._layer_grad_sq = deque(state["layer_grad_sq"], maxlen=self.history)
        self._inv_var = dict(state["inv_var"])
        self._structure = {
            k: SiteRecord(**{**r, "shape": tuple(r["shape"])})
            for k, r in state["structure"].items()
        }
