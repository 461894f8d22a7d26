"""``acgc``: per-tensor codec settings from an allowed relative gradient error (AC-GC).

The user states ``gradient_error`` e: the compressed gradient ĝ should satisfy
E‖ĝ − g‖² ≤ e²‖g‖². On calibration steps the policy reads each module's output-gradient
norm (cheap tensor hooks, no second forward) and the parameter-gradient norm, turns them
into each saved tensor's sensitivity c_t (:mod:`lightning_acgc.policies.error_model`:
an error of variance σ² per element adds c_t·σ² to ‖Δg‖²) and chooses each tensor's
codec setting (:mod:`lightning_acgc.policies.acgc_allocation`) so that the modelled
error stays within E = target · e² · ‖g‖² / κ:

* ``codec="quant"`` (default): unbiased stochastic rounding with a width per tensor from
  1 to 8 bits, 16 (float16: the ``half`` codec) or kept. Its error per element at each
  width, v_t(b), is measured on calibration steps (:mod:`~.quant_error`); tensors start at
  the fewest bits that keep every weight op within its own budget, all the tensors that
  reach it at once (:mod:`~.acgc_joint`), then greedy upgrades (best error reduction per
  added bit) bring Σ c_t·v_t(b_t) within E; the budget whole widths leave lowers a share
  of a tensor's values by one bit (``split``); a tensor at most 2/3 non-zero takes its
  width on its non-zeros only (``nonzero``, :mod:`~.acgc_nonzero`). Unbiased errors
  average out over a weight op's fan-in (2-bit quant at 14x: ``bounded``'s error at 7x).
* ``codec="bounded"``: COMET-style |x − x̂| ≤ eb (variance ≤ eb²/3), each tensor's share
  of E in proportion to its size.

The error is held per layer too (:mod:`~.acgc_corrections`; ``quant``: floors around a
layer over budget, :mod:`~.acgc_floors`, probes, :mod:`~.acgc_probes`, a global budget
loosened only as far as the layers' errors through δ allow, :mod:`~.acgc_approach`).

Verify, don't trust: with ``verify=True`` the exact gradient is computed on calibration
steps; its statistics set the settings of the same step's compressed pass, so the logged
``grad_error`` = ‖ĝ − g‖/‖g‖ measures the settings in force. κ is the ratio of measured
to modelled error. With ``quant`` it follows the readings both ways (the geometric mean
of the last ``history``; it falls at most 2x per reading) and jumps at once to the
latest reading when a measurement exceeds e; until the first reading, the allocation
aims at ``first_aim`` (1/16) of the budget. With ``bounded`` it tightens at once and
loosens at most 2x per calibration (eb²/3 is a loose upper bound). A measurement above e
is logged as ``tightened`` = 1; settings that measured over e, or a layer over its bound,
calibrate again on the next step (up to 3 in a row), not left in force until the next
scheduled calibration. With ``verify=False`` the compressed pass's statistics set the
following steps' settings and κ keeps its value. Noise-relative budget (``noise_ratio``
ρ): :mod:`~.acgc_noise`. Under 16-bit precision the error is read beyond the backward's
own rounding noise (``rounding_floor``, :mod:`~.acgc_rounding`); a calibration whose
gradients overflowed (inf or NaN: logged ``nonfinite``) is not read.

Cost (``calib_ms``): a calibration step's extra passes (exact, halves, probes, floor) and
statistics, host time; ``calib_share``: that over ``calibrate_every`` ordinary steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import torch
from torch import nn

from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.meter import SiteRecord
from lightning_acgc.engine.sites import SiteInfo, is_norm_type
from lightning_acgc.policies import error_model
from lightning_acgc.policies._acgc_stats import finite, module_norms, per_module_sq, reduce_tables
from lightning_acgc.policies._schedule import check_int
from lightning_acgc.policies.acgc_allocation import (
    average,
    bounded_bounds,
    held_layer_sq,
    layer_loads,
    quant_allocation,
    quant_meta_options,
)
from lightning_acgc.policies.acgc_approach import held_budget
from lightning_acgc.policies.acgc_corrections import ModelCorrections
from lightning_acgc.policies.acgc_floors import ScopeFloors
from lightning_acgc.policies.acgc_noise import NoiseBudget, check_budget_options
from lightning_acgc.policies.acgc_nonzero import NonzeroLayout, rounding_table
from lightning_acgc.policies.acgc_probes import SensitivityProbes
from lightning_acgc.policies.acgc_rounding import RoundingFloor
from lightning_acgc.policies.acgc_state import ACGCState
from lightning_acgc.policies.base import Reduce
from lightning_acgc.policies.batch_norm_path import BatchNormPaths
from lightning_acgc.policies.calibrating import BROKEN_RETRIES, CalibratingPolicy

__all__ = ["ACGCPolicy"]

CODECS = ("quant", "bounded")


class ACGCPolicy(
    ACGCState,
    NoiseBudget,
    ScopeFloors,
    ModelCorrections,
    RoundingFloor,
    SensitivityProbes,
    NonzeroLayout,
    CalibratingPolicy,
):
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
        target: fraction of e² the modelled error aims at (0.35: a median 0.33e measured).
        layer_floor: modules whose squared gradient is below this share of ‖g‖² are
            held to e only through the global error (default: ``layer_floor``, 1e-12).
        noise_ratio: ρ > 0: compression adds at most ρ² of the batch gradient's sampling
            variance (needs the adapter to pass the batch halves' gradients).
        noise_floor: ρ₀ > 0: with ``gradient_error``, also allow any error within ρ₀² of the
            sampling variance (:mod:`~lightning_acgc.policies.acgc_noise`).
        probes: ``quant``: tensor classes first probed per calibration (0: off; default
            ``max_probes``, 8; :mod:`~lightning_acgc.policies.acgc_probes`).
        probe_scope: which classes: ``"saturating"`` (default: the modules saving a
            softmax, tanh or sigmoid output, e.g. attention) or ``"all"``.
        rounding_floor: under 16-bit precision, read each error beyond the gradient's own
            rounding noise (one more pass per calibration; :mod:`~.acgc_rounding`).
        config: the codec and its backend: ``quant`` (default; per-tensor widths, stochastic
            rounding) or ``bounded`` (error bounds), ``codec=`` by name (``build_policy``).

    Example:
        >>> policy = ACGCPolicy(gradient_error=0.05, calibrate_every=50)
        >>> policy.needs_exact_gradient(0), policy.needs_exact_gradient(7)
        (True, False)
        >>> ACGCPolicy(noise_ratio=0.2).needs_noise_estimate(0)
        True
    """

    name = "acgc"
    derives_elementwise = True  # activation/norm/Linear outputs remade (engine/derive.py)
    codecs = CODECS  # what codec= may name; the first is the default
    options = (
        "gradient_error", "calibrate_every", "verify", "warmup_steps", "history",
        "initial_relative_bound", "group_size", "target", "noise_ratio", "layer_floor",
        "noise_floor", "probes", "probe_scope", "rounding_floor",
    )  # fmt: skip
    initial_width = 8  # quant: width before the first calibration and for unseen sites
    # quant: the first allocation aims at this share of the budget (κ unmeasured: on
    # ResNet-50 at 224² the model's error was 3.5-35x its guess, step 1 measured 1.4-5e)
    first_aim = 1 / 16
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
        noise_ratio: float | None = None,
        layer_floor: float | None = None,
        noise_floor: float | None = None,
        probes: int | None = None,
        probe_scope: str | None = None,
        rounding_floor: bool = True,
        config: CodecSpec | None = None,
    ) -> None:
        self._arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        if gradient_error is None and noise_ratio is None:
            gradient_error = 0.05
        check_budget_options(gradient_error, noise_ratio, noise_floor)
        codec = config.codec if config is not None else CODECS[0]
        if codec not in CODECS:
            raise ValueError(f"codec={codec!r} is not supported by acgc; allowed: {CODECS}")
        check_int("calibrate_every", calibrate_every, 1)
        check_int("warmup_steps", warmup_steps, 1)
        check_int("history", history, 1)
        self.set_probes(probes, probe_scope)
        if not isinstance(rounding_floor, bool):
            raise ValueError(f"rounding_floor={rounding_floor!r} must be True or False")
        if not 0 < initial_relative_bound < 1:
            raise ValueError(f"initial_relative_bound={initial_relative_bound!r} must be in (0, 1)")
        target = target if target is not None else 0.35
        if not 0 < target <= 1:
            raise ValueError(f"target={target!r} must be in (0, 1]")
        self.gradient_error = None if gradient_error is None else float(gradient_error)
        self.noise_ratio = None if noise_ratio is None else float(noise_ratio)
        self.noise_floor = None if noise_floor is None else float(noise_floor)
        self.calibrate_every = calibrate_every
        self.verify = verify
        self.rounding_floor = rounding_floor
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
        self.config = config or CodecSpec(codec)
        super().__init__()
        self.stats.batch_norm = BatchNormPaths()
        self._meta = quant_meta_options() if codec == "quant" else {}
        self._meta_bits = self._group_meta_bits("cpu")
        self.bounds: dict[str, float] = {}
        self.site_bits: dict[str, int] = {}
        self.site_split: dict[str, float] = {}  # share of the values at one bit less
        self._floors: dict[str, int] = {}  # quant: smallest width per tensor (acgc_floors)
        self.kappa = 0.5 if codec == "quant" else 4.0
        self._readings: deque[float] = deque(maxlen=history)
        self._scope_readings: dict[str, deque[float]] = {}  # λ's, by module scope
        self._own_readings: dict[str, deque[float]] = {}  # μ_m's, by weight op
        self._violated: dict[str, float] = {}  # per correction: a value that broke its budget
        self._predicted_own: dict[str, float] = {}  # per weight op, for the settings in force
        # per tensor: (numel, {weight op: fan_in·‖δ‖²}, other ops' factor) per calibration
        self._sens: dict[str, deque[tuple[int, dict[str, float], float]]] = {}
        self._grad_sq: deque[float] = deque(maxlen=history)
        self._layer_noise_sq: deque[dict[str, float]] = deque(maxlen=history)  # ‖g1_m − g2_m‖²
        self._layer_errors: dict[str, float] = {}  # e_m per module in force (noise budget)
        self._layer_grad_sq: deque[dict[str, float]] = deque(maxlen=history)
        self._structure: dict[str, SiteRecord] = {}
        self._step_sens: dict[str, error_model.TensorSensitivity] = {}  # the last calibration's
        self._norm_params: list[str] = []
        self._inv_var: dict[str, float] = {}
        self._saturating: set[str] = set()  # sites saving a saturating activation's output
        self._variances: dict[str, list[float]] = {}  # quant: v_t(b) per width of LADDER
        self._nonzero: dict[str, float] = {}  # quant: share of non-zero values (acgc_nonzero)
        self._pending_var: dict[str, torch.Tensor] = {}
        self._raw_bits: dict[str, int] = {}
        self._predicted: float | None = None
        self._exact: dict[str, torch.Tensor] | None = None
        self._exact_sq: dict[str, float] | None = None  # per module ‖g_m‖² of _exact
        self._pending_noise: dict[str, float] | None = None
        self.error_target = self.gradient_error or self.fallback_error
        self._mark = 0.0  # time of the last calibration event
        self._calib_s = 0.0
        self._step_s: float | None = None  # an ordinary step's time (between the hooks)
        self._modules: tuple[tuple[str, str], ...] | None = None  # of the model set up last

    # -- codecs ---------------------------------------------------------------
    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        if self._probe is not None:
            return self.probe_codec(site, x)
        if self._calibrating:
            start = time.perf_counter()
            self.note_tensor(site, x)  # a norm input's spread, a saturating output
            self.note_precision(x)
            if self.codec == "quant":
                self._pending_var[site.key] = rounding_table(x, self.group_size)
                self._raw_bits[site.key] = 8 * x.element_size()
            self._calib_s += time.perf_counter() - start
        return self.settings_codec(site, x)

    # -- calibration cycle ------------------------------------------------------
    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self._exact = self._exact_sq = None
        self._predicted = None
        self._pending_noise = None
        self._pending_var = {}
        self._calib_s = 0.0
        self._begin = self._mark = time.perf_counter()

    def needs_exact_gradient(self, step: int) -> bool:
        return self.verify and self.is_calibration_step(step)

    def set_exact_gradients(
        self, grads: dict[str, torch.Tensor], reduce: Reduce | None = None
    ) -> None:
        """Statistics of the exact pass set the settings of this step's compressed pass."""
        self._calib_s += self._lap()
        self._exact = {k: g.detach() for k, g in grads.items() if g is not None}
        if self._calibrating:
            grad_sq = self.stats.stop()
            module_sq = self._exact_sq = per_module_sq(self._exact)
            layer = self._held_modules(module_sq)
            g_sq = {"": sum(module_sq.values())}
            grad_sq, layer, g_sq = reduce_tables(reduce, grad_sq, layer, g_sq)
            if not finite(grad_sq, g_sq):  # (an overflowed exact pass: settings kept)
                self._metrics["nonfinite"] = 1.0
            elif self._structure:
                self._calibrate(grad_sq, g_sq[""], layer, reduce)
            elif self._noise_rho is not None:
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
        module_g, module_err = module_norms(model, self._exact, self._exact_sq, self._step_grads)
        variances = {k: v.tolist() for k, v in self._pending_var.items()}
        flat = {f"{k}\0{i}": x for k, v in variances.items() for i, x in enumerate(v)}
        grad_sq, module_g, module_err, flat = reduce_tables(
            reduce, grad_sq, module_g, module_err, flat
        )
        self.store_tables(flat, variances)  # (acgc_nonzero: each table, its non-zero share)
        module_err = self.beyond_floor(module_err, sum(module_g.values()))
        g_sq, err_sq = sum(module_g.values()), sum(module_err.values())
        if self.engine is not None:
            self._structure = {
                k: dataclasses.replace(r) for k, r in self.engine.stats.sites.items()
            }
        if not finite(grad_sq, module_g, module_err):  # overflowed (GradScaler skips it)
            self._metrics["nonfinite"] = 1.0
            self.calibrate_again(step)
        elif self._exact is not None and g_sq > 0:
            self._measure_layers(module_g, module_err, g_sq, self._measure(g_sq, err_sq))
            if self.broke_promise():  # (settings over e are not left in force)
                self.calibrate_again(step, BROKEN_RETRIES)
        elif self._exact is None and g_sq > 0:
            # cheap mode: settings for the next steps (module_g is the compressed gradient's)
            self._calibrate(grad_sq, g_sq, self._held_modules(module_g), reduce)
        self._calib_s += self._lap()
        self._log()

    def _held_modules(self, module_sq: dict[str, float]) -> dict[str, float]:
        """‖g_m‖² per module held to its own budget: every one with a gradient, 0 for own ops."""
        return {**dict.fromkeys(self._own_ops, 0.0), **module_sq}

    @property
    def _own_ops(self) -> list[str]:
        """Modules whose gradient sees a saved input directly: weight ops, affine norms."""
        return [*self.stats.fan_in, *self._norm_params]

    def setup(self, model: nn.Module) -> None:
        self.forget_other_model(model)
        super().setup(model)
        on_cuda = any(p.is_cuda for p in model.parameters())
        self._meta_bits = self._group_meta_bits("cuda" if on_cuda else "cpu")
        self._norm_params = [
            n
            for n, m in model.named_modules()
            if is_norm_type(type(m).__name__) and getattr(m, "weight", None) is not None
        ]

    def _calibrate(self, grad_sq: dict, g_sq: float, layer: dict, reduce: Reduce | None) -> None:
        paths = self.stats.batch_norm_tables(self._exact, reduce)  # BatchNorm δ paths
        sens = error_model.tensor_sensitivities(
            self._structure, grad_sq, self.stats.fan_in, self._inv_var, self._norm_params,
            paths, exact_masks=self.codec == "quant",
        )  # fmt: skip
        inv = 1.0 / g_sq if g_sq > 0 else 1.0  # kept relative to this step's ‖g‖² (_allocate)
        for key, s in sens.items():
            self._sens.setdefault(key, deque(maxlen=self.history)).append(
                (s.numel, {m: c * inv for m, c in s.weight_by_module.items()}, s.other * inv)
            )
        self._update_target(g_sq)
        self._layer_grad_sq.append({m: v * inv for m, v in layer.items()})
        self._step_sens = sens
        self.settle()

    def settle(self) -> None:
        """Allocate; the model's prediction for the settings (again after the probes)."""
        self._allocate()
        variance = {k: self._variance(k) for k in self._step_sens}
        in_force = {k: s for k, s in self._step_sens.items() if variance[k] > 0}
        # the model's own total (λ and μ_m only shift the allocation; κ scales the model)
        probed = {k: self.probed(k, s.weight_by_module, s.other) for k, s in in_force.items()}
        self._predicted = sum((sum(w.values()) + o) * variance[k] for k, (w, o) in probed.items())
        own: dict[str, float] = {}  # per weight op: the modelled error from its own input
        for k, (weights, _) in probed.items():
            for m, c in weights.items():
                own[m] = own.get(m, 0.0) + c * variance[k]
        self._predicted_own = own

    def _allocate(self) -> None:
        self._approach_used, lift = held_budget(self.aim / self.kappa, self._approach)
        self._metrics["budget_held"] = lift
        e_sq = self.error_target**2 * self.target * self._approach_used
        g_sq = self._budget_grad_sq  # relative: see there
        sens = self.probed_all(average(self._sens))
        latest = self.probed_all({k: v[-1] for k, v in self._sens.items()})
        layer_sq, held = held_layer_sq(self._layer_grad_sq, layer_loads(sens), layer_loads(latest))
        # modules not held to e themselves (below layer_floor) join the global budget
        floor = self.layer_floor * g_sq
        layer_sq = {m: v if v > floor else 0.0 for m, v in layer_sq.items()}
        # a layer's own budget is e_m²·‖g_m‖² (e_m = e without a noise budget): the
        # allocation reads it as e²·(‖g_m‖²·(e_m/e)²), κ's loosening taken out
        mean_g = self._mean_grad_sq  # layer_errors takes absolute ‖g_m‖²
        self._layer_errors = self.layer_errors({m: v * mean_g for m, v in layer_sq.items()})
        scale = self.layer_kappa / self.error_target**2
        e_m = self._layer_errors
        layer_sq = {m: v and held[m] * e_m[m] ** 2 * scale * lift for m, v in layer_sq.items()}
        share = self.own_share(sens)
        if self.codec == "bounded":
            args = (layer_sq, g_sq, e_sq, self.lam, self._own_scale, share)
            self.bounds = bounded_bounds(sens, *args)
            return
        args = (layer_sq, g_sq, e_sq, self.tensor_lam, self._own_scale, share)
        meta = self._meta_bits / self.group_size
        widths, self.site_split = quant_allocation(
            sens, self._variances, *args, self._raw_bits, meta, *self.width_limits()
        )
        self.site_bits = {**self.site_bits, **widths}
