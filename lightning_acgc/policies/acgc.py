"""``acgc``: per-tensor error bounds from an allowed relative gradient error (AC-GC).

The user states ``gradient_error`` e: the compressed gradient ĝ should satisfy
E‖ĝ − g‖² ≤ e²‖g‖². On calibration steps the policy reads each module's output-gradient
norm (cheap tensor hooks, no second forward) and the parameter-gradient norm, turns them
into each saved tensor's sensitivity c_t (:mod:`lightning_acgc.policies.error_model`) and
chooses error bounds for the ``bounded`` codec: with bound eb the error per element has
variance ≤ eb²/3, so tensor t adds c_t·eb_t²/3. Minimizing the bits Σ n_t·log2(R_t/eb_t)
under Σ c_t·eb_t²/3 = E gives each tensor the share E·n_t/N, i.e.

    eb_t = sqrt(3 · E · n_t / (N · c_t)),   E = target · e² · ‖g‖² / κ,

averaged over the last ``history`` calibrations, as AC-GC does. ``target`` (0.35) leaves
room for drift between calibrations.

The bound is held per layer too: a global ‖ĝ − g‖ ≤ e‖g‖ alone lets a layer whose
gradient is small (attention's query and key at initialization) take a 100% error
unnoticed, and then it never learns (with Adam, which rescales every coordinate, even
sooner). A layer's gradient error has two sources:

* its own saved input: a weight op's input gets at most ``layer_share`` of e²‖g_W‖²
  (analytic factor fan_in·‖δ‖²), divided by a per-layer correction μ_m;
* errors in δ, from the other ops' saved tensors (softmax output, matmul operands,
  activations, norms) downstream of it. Those ops share the rest of the global budget by
  size as above, divided by a correction λ.

On every verified calibration the error of each module's own gradient is measured
against target · e²‖g_m‖². The analytic model assumes rounding errors independent of
δ; where they are not (repeated tokens round alike), or where the error comes through
δ, a module over its budget by r tightens both sources by r: its own μ_m, and λ for the
worst module. Each correction is the largest of its last ``history`` readings (it falls
back at once where a tightening was not needed) and rises at most 16x per reading (a
source that was not the cause does not ratchet up). Modules whose gradient is below
``layer_floor`` of ‖g‖² (a key bias under softmax: zero but for rounding) are not held
to e. Measured on the BERT recipe with AdamW at e = 0.05: query and key carried 160-230%
error in their own gradients while the global error was 0.02; with the per-layer check
they stay near e.

Each tensor takes the tighter of its bounds. The worst module's measured relative error
is logged as ``layer_grad_error``, λ as ``lambda``.

Verify, don't trust: with ``verify=True`` the adapter computes the exact gradient on
calibration steps. The statistics of that exact pass set the bounds used by the same
step's compressed pass, so the logged ``grad_error`` = ‖ĝ − g‖/‖g‖ measures exactly the
bounds in force. κ is the largest ratio of measured to modelled error over the last
``history`` readings (4 before the first): a reading above the model tightens every
later bound at once; κ falls at most 2x per calibration, so bounds loosen gradually
(the error model is least reliable far from where it was last checked). A measurement
above e is logged as ``tightened`` = 1. With ``verify=False`` no exact gradient is
computed: the compressed pass's statistics set the bounds of the following steps and κ
keeps its last value.
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
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.meter import SiteRecord
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies._schedule import check_int, round_bound_down
from lightning_acgc.policies.base import Reduce
from lightning_acgc.policies.calibrating import CalibratingPolicy
from lightning_acgc.policies.error_model import NORM_TYPES, tensor_sensitivities

__all__ = ["ACGCPolicy"]

_UNCONSTRAINED = 1e30  # bound for a tensor no gradient depends on


def _per_module_sq(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Squared norm of the gradients by module (a parameter name without its last part)."""
    out: dict[str, float] = {}
    for name, g in grads.items():
        module = name.rpartition(".")[0]
        out[module] = out.get(module, 0.0) + float(g.detach().double().square().sum())
    return out


class ACGCPolicy(CalibratingPolicy):
    """Error-bounded compression with bounds derived from an allowed gradient error.

    Args:
        gradient_error: allowed relative gradient error e (0 < e < 1).
        calibrate_every: steps between calibrations (after the first ``warmup_steps``).
        verify: compute the exact gradient on calibration steps, log the measured error
            and correct the bounds with it.
        warmup_steps: the first steps of fit all calibrate.
        history: calibrations averaged (AC-GC averages its last readings).
        initial_relative_bound: bound, relative to each tensor's range, before the first
            calibration and for sites never seen.
        group_size: values per group of the ``bounded`` codec.
        target: fraction of e² the modelled error aims at (room for drift).
        config: the codec (one of ``codecs``) and its backend.

    Example:
        >>> policy = ACGCPolicy(gradient_error=0.05, calibrate_every=50)
        >>> policy.needs_exact_gradient(0), policy.needs_exact_gradient(7)
        (True, False)
    """

    name = "acgc"
    codecs = ("bounded",)  # what codec= may name; the first is the default
    options = (
        "gradient_error",
        "calibrate_every",
        "verify",
        "warmup_steps",
        "history",
        "initial_relative_bound",
        "group_size",
        "target",
    )
    initial_kappa = 4.0
    layer_share = 0.5  # part of each layer's e²‖g_W‖² that its weight op's input may use
    max_loosening = 2.0  # largest decrease of κ per reading
    max_tightening = 16.0  # largest increase of λ or μ_m per reading
    layer_floor = 1e-12  # modules with ‖g_m‖² below this share of ‖g‖² are not held to e

    def __init__(
        self,
        gradient_error: float = 0.05,
        calibrate_every: int = 100,
        verify: bool = True,
        warmup_steps: int = 3,
        history: int = 3,
        initial_relative_bound: float = 1e-3,
        group_size: int = 256,
        target: float = 0.35,
        config: CodecSpec | None = None,
    ) -> None:
        if isinstance(gradient_error, bool) or not (
            isinstance(gradient_error, (int, float)) and 0 < gradient_error < 1
        ):
            raise ValueError(f"gradient_error={gradient_error!r} must be a number in (0, 1)")
        check_int("calibrate_every", calibrate_every, 1)
        check_int("warmup_steps", warmup_steps, 1)
        check_int("history", history, 1)
        if not 0 < initial_relative_bound < 1:
            raise ValueError(f"initial_relative_bound={initial_relative_bound!r} must be in (0, 1)")
        if not 0 < target <= 1:
            raise ValueError(f"target={target!r} must be in (0, 1]")
        self.gradient_error = float(gradient_error)
        self.calibrate_every = calibrate_every
        self.verify = verify
        self.warmup_steps = warmup_steps
        self.history = history
        self.initial_relative_bound = initial_relative_bound
        self.group_size = group_size
        self.target = target
        self.config = config or CodecSpec("bounded")
        super().__init__()
        self.bounds: dict[str, float] = {}
        self.kappa = self.initial_kappa
        self._readings: deque[float] = deque(maxlen=history)
        self._layer_readings: deque[float] = deque(maxlen=history)  # λ's
        self._own_readings: dict[str, deque[float]] = {}  # μ_m's, by weight op
        self._predicted_own: dict[str, float] = {}  # per weight op, for the bounds in force
        # per tensor: (numel, {weight op: fan_in·‖δ‖²}, other ops' factor) per calibration
        self._sens: dict[str, deque[tuple[int, dict[str, float], float]]] = {}
        self._grad_sq: deque[float] = deque(maxlen=history)
        self._layer_grad_sq: deque[dict[str, float]] = deque(maxlen=history)
        self._structure: dict[str, SiteRecord] = {}
        self._inv_var: dict[str, float] = {}
        self._predicted: float | None = None
        self._exact: dict[str, torch.Tensor] | None = None

    # -- codecs ---------------------------------------------------------------
    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        if self._calibrating and site.module_type in NORM_TYPES:
            var = float(x.detach().float().var())
            if var > 0 and math.isfinite(var):
                self._inv_var[site.key] = 1.0 / var
        return self._bounded_for(site.key, self.bounds, self.initial_relative_bound)

    # -- calibration cycle ------------------------------------------------------
    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self._exact = None
        self._predicted = None

    def needs_exact_gradient(self, step: int) -> bool:
        return self.verify and self.is_calibration_step(step)

    def set_exact_gradients(
        self, grads: dict[str, torch.Tensor], reduce: Reduce | None = None
    ) -> None:
        """Statistics of the exact pass set the bounds of this step's compressed pass."""
        self._exact = {k: g.detach() for k, g in grads.items() if g is not None}
        if not self._calibrating:
            return
        start = time.perf_counter()
        grad_sq = self.stats.stop()
        module_sq = _per_module_sq(self._exact)
        layer = self._weight_ops(module_sq)
        g_sq = {"": sum(module_sq.values())}
        grad_sq, layer, g_sq = self._reduce(reduce, grad_sq, layer, g_sq)
        g_sq = g_sq[""]
        if self._structure:
            self._calibrate(grad_sq, g_sq, layer)
        self._metrics["calib_ms"] = 1e3 * (time.perf_counter() - start)

    def end_step(self, step: int, model: nn.Module, reduce: Reduce) -> None:
        if not self._calibrating:
            return
        self._calibrating = False
        start = time.perf_counter()
        grad_sq = self.stats.stop()
        module_g, module_err = self._module_norms(model)
        grad_sq, module_g, module_err = self._reduce(reduce, grad_sq, module_g, module_err)
        g_sq, err_sq = sum(module_g.values()), sum(module_err.values())
        if self.engine is not None:
            self._structure = {
                k: dataclasses.replace(r) for k, r in self.engine.stats.sites.items()
            }
        if self._exact is not None and g_sq > 0:
            self._measure(g_sq, err_sq)
            self._measure_layers(module_g, module_err, g_sq)
        elif self._exact is None and g_sq > 0:
            # cheap mode: bounds for the next steps (module_g is the compressed gradient's)
            self._calibrate(grad_sq, g_sq, self._weight_ops(module_g))
        self._metrics["calib_ms"] = self._metrics.get("calib_ms", 0.0) + 1e3 * (
            time.perf_counter() - start
        )
        self._metrics["kappa"] = self.kappa
        self._metrics["lambda"] = self.lam
        finite = [math.log10(b) for b in self.bounds.values() if b < _UNCONSTRAINED]
        if finite:
            self._metrics["log10_bound"] = sum(finite) / len(finite)

    @property
    def lam(self) -> float:
        """λ: the extra tightening of the other ops' bounds, from per-layer readings."""
        return max(self._layer_readings, default=1.0)

    def _own_scale(self, module: str) -> float:
        """μ_m: the extra tightening of weight op ``module``'s own input."""
        return max(self._own_readings.get(module, ()), default=1.0)

    def _weight_ops(self, module_sq: dict[str, float]) -> dict[str, float]:
        """‖g_W‖² per weight op (its weight and bias) from the per-module table."""
        return {m: module_sq.get(m, 0.0) for m in self.stats.fan_in}

    def _reduce(self, reduce: Reduce | None, *tables: dict[str, float]) -> list[dict[str, float]]:
        """Average the step's statistics over ranks, so every rank gets the same bounds.
        Each table's keys must be the same on every rank (module names, a fixed key)."""
        if reduce is None:
            return list(tables)
        keys = [sorted(t) for t in tables]
        values = [t[k] for t, ks in zip(tables, keys, strict=True) for k in ks]
        vec = reduce(torch.tensor(values, dtype=torch.float64)).tolist()
        out, start = [], 0
        for ks in keys:
            out.append(dict(zip(ks, vec[start : start + len(ks)], strict=True)))
            start += len(ks)
        return out

    def _module_norms(self, model: nn.Module) -> tuple[dict[str, float], dict[str, float]]:
        """Per module owning parameters: ‖g_m‖² of the reference gradient (the exact one,
        else the compressed one) and ‖ĝ_m − g_m‖² (0 without an exact gradient). Every
        module of ``model`` with parameters has an entry, so the keys match across ranks."""
        g_sq: dict[str, float] = {}
        err_sq: dict[str, float] = {}
        for name, p in model.named_parameters():
            module = name.rpartition(".")[0]
            g_sq.setdefault(module, 0.0)
            err_sq.setdefault(module, 0.0)
            if p.grad is None:
                continue
            got = p.grad.detach().double()
            ref = self._exact.get(name) if self._exact is not None else None
            if ref is None:
                g_sq[module] += float(got.square().sum())
            else:
                ref = ref.double()
                g_sq[module] += float(ref.square().sum())
                err_sq[module] += float((got - ref).square().sum())
        return g_sq, err_sq

    def _measure(self, g_sq: float, err_sq: float) -> None:
        """Log the measured error; compare it with the model's prediction for these bounds."""
        ratio = math.sqrt(err_sq / g_sq)
        self._metrics["grad_error"] = ratio
        self._metrics["tightened"] = float(ratio > self.gradient_error)
        if self._predicted is not None and self._predicted > 0:
            self._readings.append(max(err_sq / self._predicted, 1e-3))
            # Tighten at once; loosen at most 2x in variance per calibration: the error
            # model is least reliable far from where it was last checked (coarse bounds).
            self.kappa = max(max(self._readings), self.kappa / self.max_loosening)

    def _measure_layers(
        self, module_g: dict[str, float], module_err: dict[str, float], g_sq: float
    ) -> None:
        """Per-layer check. A module over its budget target · e²‖g_m‖² by a factor r
        tightens, by r, both possible sources: its own input's bound (μ_m, weight ops) and
        the other ops' bounds (λ, for the worst module). Each correction is the largest of
        its last ``history`` readings, so it falls back at once where a tightening was not
        needed, and rises at most ``max_tightening`` per reading, so a source that was not
        the cause does not ratchet up."""
        budget = self.target * self.gradient_error**2
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
            return  # the bounds in force were not allocated this step (first step)
        # Modules over budget set λ by their δ part (an over-budget module whose own input
        # explains its error lets λ fall); with all within budget λ may fall to what the
        # worst module leaves room for.
        over = [through_delta[m] for m, r in needs.items() if r > 1]
        lam_need = max(over) if over else max(needs.values())
        self._add_reading(self._layer_readings, lam_need)
        for module in self.stats.fan_in:
            readings = self._own_readings.setdefault(module, deque(maxlen=self.history))
            self._add_reading(readings, needs.get(module, 0.0))

    def _add_reading(self, readings: deque[float], need: float) -> None:
        """One reading of a per-layer correction (the largest of its ``readings``): the
        value times ``need`` would have put the layer on budget; kept within
        [1, value · max_tightening]."""
        value = max(readings, default=1.0)
        readings.append(min(max(value * need, 1.0), value * self.max_tightening))

    def _calibrate(self, grad_sq: dict[str, float], g_sq: float, layer: dict[str, float]) -> None:
        sens = tensor_sensitivities(self._structure, grad_sq, self.stats.fan_in, self._inv_var)
        for key, s in sens.items():
            self._sens.setdefault(key, deque(maxlen=self.history)).append(
                (s.numel, dict(s.weight_by_module), s.other)
            )
        self._grad_sq.append(g_sq)
        self._layer_grad_sq.append(layer)
        self._allocate()
        in_force = {
            k: s for k, s in sens.items() if self.bounds.get(k, _UNCONSTRAINED) < _UNCONSTRAINED
        }
        self._predicted = sum(s.total * self.bounds[k] ** 2 / 3 for k, s in in_force.items())
        own: dict[str, float] = {}  # per weight op: the modelled error from its own input
        for k, s in in_force.items():
            for m, c in s.weight_by_module.items():
                own[m] = own.get(m, 0.0) + c * self.bounds[k] ** 2 / 3
        self._predicted_own = own

    def _allocate(self) -> None:
        e_sq = self.gradient_error**2 * self.target / self.kappa
        g_sq = sum(self._grad_sq) / len(self._grad_sq)
        layer_sq: dict[str, float] = {}
        for reading in self._layer_grad_sq:
            for m, v in reading.items():
                layer_sq[m] = layer_sq.get(m, 0.0) + v / len(self._layer_grad_sq)
        averaged = {}
        for key, hist in self._sens.items():
            weights: dict[str, float] = {}
            for _, w, _ in hist:
                for m, c in w.items():
                    weights[m] = weights.get(m, 0.0) + c / len(hist)
            averaged[key] = (hist[-1][0], weights, sum(o for _, _, o in hist) / len(hist))
        others = sum(n for n, _, o in averaged.values() if o > 0)
        bounds = {}
        for key, (n, weights, other) in averaged.items():
            eb = _UNCONSTRAINED
            for m, c in weights.items():
                if c > 0 and layer_sq.get(m, 0.0) > 0:  # this layer's own share
                    own = self.layer_share * e_sq * layer_sq[m] / self._own_scale(m)
                    eb = min(eb, math.sqrt(3 * own / c))
                elif c > 0:  # no gradient of its own to compare with: the global budget
                    other += c
            if other > 0:
                rest = (1 - self.layer_share) * e_sq * g_sq / self.lam
                eb = min(eb, math.sqrt(3 * rest * n / (max(others, n) * other)))
            bounds[key] = round_bound_down(min(max(eb, 1e-30), _UNCONSTRAINED))
        self.bounds = bounds

    # -- reporting and state ---------------------------------------------------
    def site_settings(self) -> dict[str, str]:
        return {k: f"eb={b:.3g}" for k, b in sorted(self.bounds.items())}

    def state_dict(self) -> dict[str, Any]:
        return {
            "bounds": dict(self.bounds),
            "kappa": self.kappa,
            "readings": list(self._readings),
            "layer_readings": list(self._layer_readings),
            "own_readings": {m: list(v) for m, v in self._own_readings.items()},
            "sens": {k: list(v) for k, v in self._sens.items()},
            "grad_sq": list(self._grad_sq),
            "layer_grad_sq": list(self._layer_grad_sq),
            "inv_var": dict(self._inv_var),
            "structure": {k: dataclasses.asdict(r) for k, r in self._structure.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bounds = dict(state["bounds"])
        self.kappa = float(state["kappa"])
        self._readings = deque(state["readings"], maxlen=self.history)
        # (checkpoints written before the per-layer check have none of these)
        self._layer_readings = deque(state.get("layer_readings", ()), maxlen=self.history)
        self._own_readings = {
            m: deque(v, maxlen=self.history) for m, v in state.get("own_readings", {}).items()
        }
        self._sens = {
            k: deque((tuple(h) for h in v), maxlen=self.history) for k, v in state["sens"].items()
        }
        self._grad_sq = deque(state["grad_sq"], maxlen=self.history)
        self._layer_grad_sq = deque(state["layer_grad_sq"], maxlen=self.history)
        self._inv_var = dict(state["inv_var"])
        self._structure = {
            k: SiteRecord(**{**r, "shape": tuple(r["shape"])})
            for k, r in state["structure"].items()
        }
