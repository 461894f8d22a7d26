"""acgc's checkpoint state (what a resumed run needs to continue with the same settings)
and its settings as reported."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch
from torch import nn

from lightning_acgc.codecs.base import Codec
from lightning_acgc.engine.meter import SiteRecord
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies.bit_allocation import HALF, KEEP, LADDER
from lightning_acgc.policies.error_model import SATURATING_TYPES, SOFTMAX_TYPES

__all__ = ["ACGCState"]


class ACGCState:
    """``state_dict``/``load_state_dict``, ``site_settings``, ``settings_codec`` and ``describe`` of
    :class:`~lightning_acgc.policies.acgc.ACGCPolicy` (a mixin over its attributes)."""

    history: int
    codec: str

    def forget_other_model(self, model: nn.Module) -> None:
        """Start afresh where ``model`` is not the model this policy was set up with last
        (the same callback in a fit of another model): what it learned is per site and
        module of that model; its stale sites took budget from the new ones and broke the
        log. The same model (by module names and types) keeps it."""
        modules = tuple((name, type(m).__name__) for name, m in model.named_modules())
        if self._modules is not None and modules != self._modules:
            self.__init__(**self._arguments)  # type: ignore[misc]
        self._modules = modules

    def state_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "bounds": dict(self.bounds),
            "site_bits": dict(self.site_bits),
            "site_split": dict(self.site_split),
            "floors": dict(self._floors),
            "variances": {k: list(v) for k, v in self._variances.items()},
            "raw_bits": dict(self._raw_bits),
            "nonzero": dict(self._nonzero),
            "kappa": self.kappa,
            "error_target": self.error_target,
            "readings": list(self._readings),
            "aim_climbs": self._aim_climbs,
            "approach": [self._approach, self._approach_used],
            "scope_readings": {k: list(v) for k, v in self._scope_readings.items()},
            "own_readings": {m: list(v) for m, v in self._own_readings.items()},
            "violated": dict(self._violated),
            "sens": {k: list(v) for k, v in self._sens.items()},
            "sens_relative": True,
            "grad_sq": list(self._grad_sq),
            "layer_noise_sq": list(self._layer_noise_sq),
            "layer_grad_sq": list(self._layer_grad_sq),
            "inv_var": dict(self._inv_var),
            "saturating": sorted(self._saturating),
            "softmax": sorted(self._softmax),
            "softmax_held": sorted(self._softmax_held),
            "checkpoint_inputs": sorted(self._checkpoint_inputs),
            "checkpoint_held": dict(self._checkpoint_held),
            "checkpoint_kinked": dict(self._regions.kinked),
            "structure": {k: dataclasses.asdict(r) for k, r in self._structure.items()},
            "probe_readings": {k: list(v) for k, v in self._probe_readings.items()},
            "probed_at": dict(self._probed_at),
            "probe_count": self._probe_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (checkpoints written before the quant codec or the per-layer check lack some)
        self.bounds = dict(state["bounds"])
        self.site_bits = {k: int(v) for k, v in state.get("site_bits", {}).items()}
        self.site_split = {k: float(v) for k, v in state.get("site_split", {}).items()}
        self._floors = {k: int(v) for k, v in state.get("floors", {}).items()}
        # (tables of another width ladder, e.g. 1/2/4/8 only, are measured anew)
        self._variances = {
            k: list(v) for k, v in state.get("variances", {}).items() if len(v) == len(LADDER)
        }
        self._raw_bits = dict(state.get("raw_bits", {}))
        self._nonzero = {k: float(v) for k, v in state.get("nonzero", {}).items()}
        self.kappa = float(state["kappa"])
        self.error_target = float(state.get("error_target", self.error_target))
        self._readings = deque(state["readings"], maxlen=self.history)
        self._aim_climbs = int(state.get("aim_climbs", 0))
        self._approach, self._approach_used = state.get("approach", (None, None))
        scopes = state.get("scope_readings", {"": state.get("layer_readings", ())})
        self._scope_readings = {k: deque(v, maxlen=self.history) for k, v in scopes.items()}
        self._violated = dict(state.get("violated", {}))
        self._own_readings = {
            m: deque(v, maxlen=self.history) for m, v in state.get("own_readings", {}).items()
        }
        self._sens = {
            k: deque((tuple(h) for h in v), maxlen=self.history) for k, v in state["sens"].items()
        }
        self._grad_sq = deque(state["grad_sq"], maxlen=self.history)
        # (checkpoints from before the per-layer noise budget hold the totals alone)
        noise = state.get("layer_noise_sq") or [{"": v} for v in state.get("noise_sq", ())]
        self._layer_noise_sq = deque(noise, maxlen=self.history)
        self._layer_grad_sq = deque(state["layer_grad_sq"], maxlen=self.history)
        if not state.get("sens_relative", False):  # absolute readings: measured anew
            self._sens, self._layer_grad_sq = {}, deque(maxlen=self.history)
        self._inv_var = dict(state["inv_var"])
        self._structure = {
            k: SiteRecord(**{**r, "shape": tuple(r["shape"])})
            for k, r in state["structure"].items()
        }
        # (checkpoints from before the saturating sites were noted: those of their type)
        saturating = [k for k, r in self._structure.items() if r.module_type in SATURATING_TYPES]
        self._saturating = set(state.get("saturating", saturating))
        softmax = [k for k, r in self._structure.items() if r.module_type in SOFTMAX_TYPES]
        self._softmax = set(state.get("softmax", softmax))
        self._softmax_held = set(state.get("softmax_held", ()))
        self._checkpoint_inputs = set(state.get("checkpoint_inputs", ()))
        held = state.get("checkpoint_held", {})  # a list before the graded holds: kept
        self._checkpoint_held = dict.fromkeys(held, KEEP) if isinstance(held, list) else dict(held)
        self._regions.kinked = dict(state.get("checkpoint_kinked", {}))
        self._probe_readings = {
            k: deque(v, maxlen=self.history) for k, v in state.get("probe_readings", {}).items()
        }
        self._probed_at = {c: int(n) for c, n in state.get("probed_at", {}).items()}
        self._probe_count = int(state.get("probe_count", 0))
        self._modules = None  # the state of the model being resumed, whichever was set up

    def site_settings(self) -> dict[str, str]:
        if self.codec == "bounded":
            return {k: f"eb={b:.3g}" for k, b in sorted(self.bounds.items())}
        return {
            k: "kept" if b == KEEP else f"bits={b - self.site_split.get(k, 0.0):g}"
            for k, b in sorted(self.site_bits.items())
        }

    def settings_codec(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        """The codec of the settings in force for ``site`` (``None``: kept as it is)."""
        if self.codec == "bounded":
            return self._bounded_for(site.key, self.bounds, self.initial_relative_bound)
        bits = self.site_bits.get(site.key)
        bits = self.first_width(site) if bits is None else bits
        if bits in (KEEP, HALF):
            return None if bits == KEEP else self._codec("half")
        return self.quant_codec(site.key, bits, self.site_split.get(site.key, 0.0))

    def describe(self, codec: Codec) -> str:
        if codec.name == "quant":
            return f"bits={codec.config.bits}"
        if codec.name == "split":  # the mean width: a share of the values a bit narrower
            return f"bits={codec.config.mean_bits:g}"
        if codec.name == "nonzero":  # the mean width of the non-zero values
            return f"nonzero bits={codec.config.mean_bits:g}"
        return super().describe(codec)  # type: ignore[misc]
