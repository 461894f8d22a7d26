"""acgc's sensitivity probes: the measured effect of the tensors the error model guesses.

The error model (:mod:`lightning_acgc.policies.error_model`) is exact in expectation for
a weight op's saved input, but for every other saved tensor (a norm's input, an
activation's output, what an attention module saves inside) it uses one heuristic
factor per module: ``mean fan-in · ‖δ‖²``. Measured against the exact gradient on the
quick BERT recipe (4-bit rounding of one kind of tensor in every layer) that factor is
500-2000x too high for the query, key and value an attention module saves for its
products and 25x too low for its dropped-out probabilities; on the quick ResNet it is
3-25x too high for BatchNorm inputs and ReLU outputs. The allocation then spends its
bits where they buy nothing: BERT-base at e = 0.05 kept q, k and v at 32 bits, 44% of
the bytes it kept.

On by default for the modules that save a saturating activation's output
(``probe_scope="saturating"``: an attention's softmax, with its query, key, value and
dropped probabilities, where the factor is furthest off); ``probe_scope="all"`` probes
every guessed class, ``probes=0`` none. Each tensor they found reaching a layer held
alone to that layer's whole budget, BERT-base at e = 0.05 kept 6.1x but the quick
transformer's attention went 3x over it; with each budget split among its tensors
beforehand, 3.2x against 4.1x without probes. Met jointly
(:mod:`~lightning_acgc.policies.acgc_joint`), and once every class in scope has a reading
with 0.8 of each layer's budget for its measured tensors
(:meth:`~SensitivityProbes.own_share`), BERT-base (batch 4, sequence 128) keeps 5.19x
with the default scope, every layer within e on the measured step (worst 0.036; without
probes 4.34x, its worst layer at 0.055; every class probed, 5.23x). Probing every class
cost the ResNets and the GCN ratio (BatchNorm inputs and ReLU outputs held at
``PROBE_WIDTH`` or more) and the quick recipes' paired-seed fits gained no loss; probing
the saturating modules' classes alone leaves those models as they were (they save no
saturating output) and raised the quick transformers' ratios (README's sweep table).

A probe measures instead. On a verified calibration, after the exact gradient: one more
forward and backward of the same batch (random state restored) with only one *class* of
tensors compressed, at ``PROBE_WIDTH`` bits, every other saved tensor kept. A class is
a site key with the numeric parts of its module path replaced (the same tensor of every
block of a stack: ``encoder.layer.*.attention.self:0``). Each module's measured
‖ĝ_m − g_m‖² is put on the class's tensor nearest to it (the longest common module path;
ties share), as a factor per unit of that tensor's rounding variance: the tensor's
sensitivity then has one entry per module it reaches, like a weight op's input, so the
per-layer promise sees it (rounding the query moves the key's gradient, a small one),
and its heuristic other-op factor is dropped. Each entry is kept as a multiple of that
heuristic factor, which follows ‖δ‖² from calibration to calibration. Only classes whose
modelled error is mostly the heuristic part are probed. Each calibration probes up to
``max_probes`` classes not probed yet, the most bytes first (BERT-base: 15 classes, so
the warm-up's second and third calibrations take 8 and 7 more passes, a one-time cost);
once all are, it re-probes ``probe_refresh`` class, the oldest reading first. A probed
tensor keeps at least ``PROBE_WIDTH`` bits: below it the reading says nothing (at 1 bit
a ReLU output loses its exact zeros, its backward's mask).
"""

from __future__ import annotations

import math
import re
from collections import deque

import torch

from lightning_acgc.codecs._checks import check_choice
from lightning_acgc.codecs.base import Codec
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies._acgc_stats import per_module_sq_diff
from lightning_acgc.policies._schedule import check_int
from lightning_acgc.policies.acgc_allocation import Sensitivity, average
from lightning_acgc.policies.bit_allocation import LADDER

__all__ = ["PROBE_SCOPES", "PROBE_WIDTH", "SensitivityProbes", "tensor_class"]

PROBE_WIDTH = 2
PROBE_SCOPES = ("saturating", "all")
PROBED_SHARE = 0.8  # own_share once every class is probed (0.5: layer_share, unprobed)
_INDEX = re.compile(r"\.\d+(?=[.:])")


def tensor_class(key: str) -> str:
    """The probe class of site ``key``: its module path with numeric parts as ``*``.

    Example:
        >>> tensor_class("net.encoder.layer.11.attention.self:4")
        'net.encoder.layer.*.attention.self:4'
        >>> tensor_class("net.layer1.0.bn1:0")
        'net.layer1.*.bn1:0'
    """
    return _INDEX.sub(".*", key)


class SensitivityProbes:
    """Mixin of :class:`~lightning_acgc.policies.acgc.ACGCPolicy` (``quant`` codec):
    probes per tensor class and the per-module factors they measure (module docstring).
    Uses the policy's ``codec``, ``verify``, ``history``, ``group_size``, ``_meta``,
    ``_saturating``, ``_calibrating``, ``_exact``, ``_sens``, ``_variances``,
    ``_metrics``, ``_calib_s``, ``_lap``, ``settle`` and ``quant_codec``."""

    probe_refresh = 1  # classes re-probed per calibration once all have a reading
    # classes first probed per calibration (the largest first; ``probes=``, 0: off)
    max_probes = 8
    probe_scope = "saturating"  # which classes (``probe_scope=``): see PROBE_SCOPES

    def __init__(self) -> None:
        super().__init__()
        self._probe: str | None = None  # the class being probed
        self._probe_var: dict[str, float] = {}  # its tensors' variance at PROBE_WIDTH
        # per probed tensor: its measured factor per module, per reading
        self._probe_readings: dict[str, deque[dict[str, float]]] = {}
        self._probed_at: dict[str, int] = {}  # class -> calibration count of its last probe
        self._probe_count = 0  # calibrations that probed

    def set_probes(self, probes: int | None, scope: str | None) -> None:
        """The ``probes`` and ``probe_scope`` options (None: the class's defaults).

        Raises:
            ValueError: ``probes`` not an integer >= 0, or ``scope`` not in PROBE_SCOPES.
        """
        if probes is not None:
            check_int("probes", probes, 0)
            self.max_probes = probes
        if scope is not None:
            check_choice("probe_scope", scope, PROBE_SCOPES)
            self.probe_scope = scope

    # -- which classes ------------------------------------------------------------
    def _probe_candidates(self) -> dict[str, int]:
        """Bytes per class of the tensors whose modelled error is mostly the heuristic
        other-op part (the weight-op part is exact in expectation: nothing to learn), in
        scope: with ``"saturating"``, those of the modules that saved a saturating
        activation's output (:meth:`note_tensor`: an attention's softmax, a gate)."""
        out: dict[str, int] = {}
        modules = {k.rpartition(":")[0] for k in self._saturating}
        for key, (numel, weights, other) in average(self._sens).items():
            if self.probe_scope == "saturating" and key.rpartition(":")[0] not in modules:
                continue
            if key in self._variances and other > sum(weights.values()):
                cls = tensor_class(key)
                out[cls] = out.get(cls, 0) + numel
        return out

    def probe_classes(self, step: int) -> list[str]:
        """The classes to probe on ``step`` (after its exact gradient): up to
        ``max_probes`` not yet probed (the most bytes first), else the ``probe_refresh``
        probed longest ago; none off calibration."""
        if not (self.max_probes and self.codec == "quant" and self.verify and self._calibrating):
            return []
        if self._exact is None or not self._sens:
            return []
        candidates = self._probe_candidates()
        fresh = sorted((c for c in candidates if c not in self._probed_at), key=candidates.get)
        chosen = (
            fresh[::-1][: self.max_probes]
            or sorted(candidates, key=self._probed_at.__getitem__)[: self.probe_refresh]
        )
        self._probe_count += bool(chosen)
        return chosen

    # -- one probe ------------------------------------------------------------------
    def begin_probe(self, cls: str) -> None:
        """The next pass compresses class ``cls`` only (see :meth:`probe_codec`)."""
        self._probe, self._probe_var = cls, {}

    def probe_codec(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        """In a probe pass: ``PROBE_WIDTH`` bits for the probed class's tensors with a
        variance table, nothing for every other tensor."""
        table = self._variances.get(site.key)
        if table is None or tensor_class(site.key) != self._probe or not x.is_floating_point():
            return None
        self._probe_var[site.key] = table[LADDER.index(PROBE_WIDTH)]
        return self.quant_codec(site.key, PROBE_WIDTH)

    def end_probe(self, cls: str, grads: dict[str, torch.Tensor] | None) -> None:
        """Read the probe pass's gradient ``grads`` against the exact one: per module, its
        error on the class's nearest tensor, per unit of that tensor's variance, as a
        multiple of the tensor's heuristic factor now (so that it follows ‖δ‖² as the
        gradients shrink: absolute readings from early steps, 100x too high once the loss
        had fallen, broke the per-layer promise by 1.7x and left 1.3x)."""
        self._probe, probed = None, self._probe_var
        self._probed_at[cls] = self._probe_count
        if grads is None or self._exact is None or not probed:
            return
        sens = average({k: self._sens[k] for k in probed if k in self._sens})
        probed = {k: v for k, v in probed.items() if k in sens and sens[k][2] > 0}
        err = self.beyond_floor(per_module_sq_diff(grads, self._exact))  # (acgc_rounding)
        factors: dict[str, dict[str, float]] = {k: {} for k in probed}
        for module, e in err.items():
            if probed and e > 0 and math.isfinite(e):
                nearest = _nearest(module, list(probed))
                var = sum(probed[k] for k in nearest)
                # sens is relative to its step's ‖g‖² (acgc._calibrate); e is absolute
                scale = var * (self._grad_sq[-1] if self._grad_sq else 1.0)
                for k in nearest:
                    factors[k][module] = e / scale / sens[k][2] if scale > 0 else 0.0
        for key, f in factors.items():
            self._probe_readings.setdefault(key, deque(maxlen=self.history)).append(f)
        self._metrics["probes"] = self._metrics.get("probes", 0.0) + 1

    def probes_done(self) -> None:
        """After the step's probes: the step's settings allocated again with them."""
        if self._metrics.get("probes"):
            self.settle()
            self._calib_s += self._lap()  # the probe passes and the settling

    # -- what the allocation reads -----------------------------------------------------
    def own_share(self, sens: dict[str, Sensitivity] | None = None) -> float:
        """The share of each layer's budget its measured tensors may fill: ``layer_share``
        (the rest for errors reaching it through δ, which the model guesses), or
        ``PROBED_SHARE`` where nothing is left to a guess: once every candidate class has a
        probe reading, or where no tensor has a heuristic factor at all (a ResNet: its
        BatchNorm inputs modelled, :mod:`~.batch_norm_path`; what reaches a layer through
        δ is then in its own budget). On the quick ResNet 0.5 instead kept 5.4x, 0.8 6.1x.
        ``sens``: :meth:`probed_all` of the averaged sensitivities, where at hand."""
        sens = self.probed_all(average(self._sens)) if sens is None else sens
        if sens and not any(o > 0 for _, _, o in sens.values()):
            return PROBED_SHARE
        if self.max_probes and self._probe_readings:
            candidates = self._probe_candidates()
            if candidates and all(c in self._probed_at for c in candidates):
                return PROBED_SHARE
        return self.layer_share

    def probe_ratios(self, key: str) -> dict[str, float] | None:
        """Tensor ``key``'s measured factor per module over its heuristic factor (mean of
        its readings; a module missing from a reading counts 0), ``None`` if never
        probed."""
        readings = self._probe_readings.get(key)
        if not readings:
            return None
        out: dict[str, float] = {}
        for reading in readings:
            for m, c in reading.items():
                out[m] = out.get(m, 0.0) + c / len(readings)
        return out

    def probed(
        self, key: str, weights: dict[str, float], other: float
    ) -> tuple[dict[str, float], float]:
        """A sensitivity with the probe's factors: its weight-op entries (analytic) kept,
        the measured ones added for every other module, the heuristic ``other`` dropped."""
        ratios = self.probe_ratios(key)
        if not ratios or not any(ratios.values()):
            return weights, other  # (exact at the probe's width: its variance table says so)
        return {**{m: r * other for m, r in ratios.items()}, **weights}, 0.0

    def other_factor(self, key: str, weights: dict[str, float], other: float) -> float:
        """The part of a sensitivity outside its weight-op entries: measured (the probe's
        factors for the other modules) or, never probed, the heuristic ``other``."""
        measured, left = self.probed(key, weights, other)
        return left + sum(c for m, c in measured.items() if m not in weights)

    def probed_all(self, sens: dict[str, Sensitivity]) -> dict[str, Sensitivity]:
        """:meth:`probed` over averaged sensitivities ``(numel, weights, other)``."""
        return {k: (n, *self.probed(k, w, o)) for k, (n, w, o) in sens.items()}

    def probe_floors(self) -> dict[str, int]:
        """``PROBE_WIDTH`` for the probed tensors (below it a reading says nothing)."""
        return {k: PROBE_WIDTH for k in self._probe_readings if k in self._variances}


def _nearest(module: str, keys: list[str]) -> list[str]:
    """The site keys whose module path shares the most leading parts with ``module``."""
    parts = module.split(".")

    def common(key: str) -> int:
        n = 0
        for a, b in zip(parts, key.rpartition(":")[0].split("."), strict=False):
            if a != b:
                break
            n += 1
        return n

    best = max(map(common, keys))
    return [k for k in keys if common(k) == best]
