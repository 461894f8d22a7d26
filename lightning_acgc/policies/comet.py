"""``comet``: error-bounded compression with COMET's adaptive per-layer bound.

Each site's absolute bound follows its own statistics over training: the bound is
``relative_bound`` times a running average of the site's value range, scaled down where
the layer's gradient sensitivity is high and up where it is low (relative to the
median site, clipped to [1/10, 10]). Statistics are read on calibration steps.
Batch-size raising into the freed memory is the adapter's ``scale_batch_size``.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
from torch import nn

from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies._schedule import check_int, round_bound_down
from lightning_acgc.policies.base import Reduce
from lightning_acgc.policies.calibrating import CalibratingPolicy
from lightning_acgc.policies.error_model import tensor_sensitivities

__all__ = ["CometPolicy"]


class CometPolicy(CalibratingPolicy):
    """Per-site error bounds that track activation ranges and gradient sensitivity.

    Args:
        relative_bound: bound as a fraction of the site's average value range.
        calibrate_every: steps between calibrations (after the first ``warmup_steps``).
        warmup_steps: the first steps of fit all calibrate.
        momentum: weight of the old average when a new range is read (0 to 1).
        group_size: values per group of the ``bounded`` codec.
        config: the codec (one of ``codecs``) and its backend.

    Example:
        >>> CometPolicy(relative_bound=0.01).relative_bound
        0.01
    """

    name = "comet"
    codecs = ("bounded",)  # what codec= may name; the first is the default
    options = (
        "relative_bound",
        "calibrate_every",
        "warmup_steps",
        "momentum",
        "group_size",
    )

    def __init__(
        self,
        relative_bound: float = 1e-2,
        calibrate_every: int = 100,
        warmup_steps: int = 3,
        momentum: float = 0.9,
        group_size: int = 256,
        config: CodecSpec | None = None,
    ) -> None:
        if not (isinstance(relative_bound, (int, float)) and 0 < relative_bound < 1):
            raise ValueError(f"relative_bound={relative_bound!r} must be a number in (0, 1)")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum={momentum!r} must be in [0, 1)")
        check_int("calibrate_every", calibrate_every, 1)
        check_int("warmup_steps", warmup_steps, 1)
        self.relative_bound = float(relative_bound)
        self.calibrate_every = calibrate_every
        self.warmup_steps = warmup_steps
        self.momentum = momentum
        self.group_size = group_size
        self.config = config or CodecSpec("bounded")
        super().__init__()
        self.ranges: dict[str, float] = {}
        self.bounds: dict[str, float] = {}
        self._step_ranges: dict[str, float] = {}

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        if self._calibrating:
            finite = x.detach()[torch.isfinite(x.detach())]
            if finite.numel():
                lo, hi = torch.aminmax(finite)
                self._step_ranges[site.key] = float(hi.double() - lo.double())
        return self._bounded_for(site.key, self.bounds, self.relative_bound)

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        if self._calibrating:
            self._step_ranges = {}

    def end_step(self, step: int, model: nn.Module, reduce: Reduce) -> None:
        if not self._calibrating:
            return
        self._calibrating = False
        grad_sq = self._reduced_grad_sq(reduce)
        keys = sorted(self._step_ranges)
        seen = reduce(torch.tensor([self._step_ranges[k] for k in keys], dtype=torch.float64))
        for key, r in zip(keys, seen.tolist(), strict=True):
            old = self.ranges.get(key)
            self.ranges[key] = r if old is None else self.momentum * old + (1 - self.momentum) * r
        records = self.engine.stats.sites if self.engine is not None else {}
        sens = {
            k: s.total for k, s in tensor_sensitivities(records, grad_sq, self.stats.fan_in).items()
        }
        positive = [c for c in sens.values() if c > 0]
        median = statistics.median(positive) if positive else 0.0
        bounds = {}
        for key, r in self.ranges.items():
            if r <= 0 or not math.isfinite(r):
                continue
            c = sens.get(key, 0.0)
            scale = min(10.0, max(0.1, math.sqrt(median / c))) if c > 0 and median > 0 else 1.0
            bounds[key] = round_bound_down(self.relative_bound * r * scale)
        self.bounds = bounds

    def site_settings(self) -> dict[str, str]:
        return {k: f"eb={b:.3g}" for k, b in sorted(self.bounds.items())}

    def state_dict(self) -> dict[str, Any]:
        return {"ranges": dict(self.ranges), "bounds": dict(self.bounds)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ranges = dict(state["ranges"])
        self.bounds = dict(state["bounds"])
