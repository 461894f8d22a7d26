"""``gact``: per-tensor bit widths under an average bit budget (GACT).

On calibration steps each packed tensor gets a weight w_t = c_t · R̄_t², where c_t is
its gradient sensitivity (:mod:`lightning_acgc.policies.error_model`) and R̄_t² the mean
squared range of its quantization groups: stochastic rounding with step R/(2^b − 1)
adds gradient variance proportional to w_t/(2^b − 1)². Bits in {1, 2, 4, 8} then come
from :func:`lightning_acgc.policies.bit_allocation.allocate_bits`. BatchNorm inputs are
quantized per channel-normalized value, as in ``fixed``
(:class:`~lightning_acgc.codecs.channels.ChannelNormalized`); their ranges are still
measured on the raw values, which overstates their error (more bits, not fewer).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
from torch import nn

from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.kernels.quant import group_view
from lightning_acgc.policies._schedule import check_int
from lightning_acgc.policies.base import Reduce
from lightning_acgc.policies.bit_allocation import POW2, allocate_bits
from lightning_acgc.policies.calibrating import CalibratingPolicy
from lightning_acgc.policies.error_model import (
    is_batch_norm_input,
    tensor_sensitivities,
)

__all__ = ["GACTPolicy"]


class GACTPolicy(CalibratingPolicy):
    """Quantization with bits per tensor chosen from measured sensitivity.

    Args:
        bits: average bit budget over the packed elements (1 to 8; e.g. 2, 3, 4).
        calibrate_every: steps between calibrations (after the first ``warmup_steps``).
        warmup_steps: the first steps of fit all calibrate.
        history: calibrations averaged.
        group_size: values per group of the ``quant`` codec.
        config: the codec (one of ``codecs``) and its backend.

    Example:
        >>> GACTPolicy(bits=3).default_bits
        2
    """

    name = "gact"
    codecs = ("quant",)  # what codec= may name; the first is the default
    options = (
        "bits",
        "calibrate_every",
        "warmup_steps",
        "history",
        "group_size",
    )

    def __init__(
        self,
        bits: float = 2.0,
        calibrate_every: int = 100,
        warmup_steps: int = 1,
        history: int = 3,
        group_size: int = 256,
        config: CodecSpec | None = None,
    ) -> None:
        if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 1 <= bits <= 8:
            raise ValueError(f"bits={bits!r} must be an average bit budget between 1 and 8")
        check_int("calibrate_every", calibrate_every, 1)
        check_int("warmup_steps", warmup_steps, 1)
        check_int("history", history, 1)
        self.bits = float(bits)
        self.calibrate_every = calibrate_every
        self.warmup_steps = warmup_steps
        self.history = history
        self.group_size = group_size
        self.config = config or CodecSpec("quant")
        self.default_bits = max(b for b in POW2 if b <= self.bits)
        super().__init__()
        self.site_bits: dict[str, int] = {}
        self._range_sq: dict[str, float] = {}
        self._weights: dict[str, deque[tuple[int, float]]] = {}

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        if self._calibrating:
            lo, hi = torch.aminmax(group_view(x.detach(), self.group_size), dim=1)
            span = (hi - lo).nan_to_num(0.0, 0.0, 0.0)
            self._range_sq[site.key] = float(span.double().square().mean())
        bits = self.site_bits.get(site.key, self.default_bits)
        codec = self._codec("quant", bits=bits, group_size=self.group_size)
        return self._norm_input(codec) if is_batch_norm_input(site.module_type, x) else codec

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        if self._calibrating:
            self._range_sq = {}

    def end_step(self, step: int, model: nn.Module, reduce: Reduce) -> None:
        if not self._calibrating:
            return
        self._calibrating = False
        start = time.perf_counter()
        grad_sq = self._reduced_grad_sq(reduce)
        records = self.engine.stats.sites if self.engine is not None else {}
        sens = tensor_sensitivities(records, grad_sq, self.stats.fan_in)
        keys = sorted(k for k in sens if k in self._range_sq)
        ranges = reduce(torch.tensor([self._range_sq[k] for k in keys], dtype=torch.float64))
        for key, r_sq in zip(keys, ranges.tolist(), strict=True):
            hist = self._weights.setdefault(key, deque(maxlen=self.history))
            hist.append((sens[key].numel, sens[key].total * r_sq))
        keys = sorted(self._weights)
        sizes = [self._weights[k][-1][0] for k in keys]
        weights = [sum(w for _, w in self._weights[k]) / len(self._weights[k]) for k in keys]
        if keys:
            self.site_bits = dict(zip(keys, allocate_bits(sizes, weights, self.bits), strict=True))
            total = sum(sizes)
            avg = sum(n * self.site_bits[k] for n, k in zip(sizes, keys, strict=True)) / total
            self._metrics["avg_bits"] = avg
        self._metrics["calib_ms"] = 1e3 * (time.perf_counter() - start)

    def site_settings(self) -> dict[str, str]:
        return {k: f"bits={b}" for k, b in sorted(self.site_bits.items())}

    def state_dict(self) -> dict[str, Any]:
        return {
            "site_bits": dict(self.site_bits),
            "weights": {k: list(v) for k, v in self._weights.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.site_bits = {k: int(v) for k, v in state["site_bits"].items()}
        self._weights = {
            k: deque(map(tuple, v), maxlen=self.history) for k, v in state["weights"].items()
        }
