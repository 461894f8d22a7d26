"""What the calibrating policies (acgc, gact, comet) share: gradient statistics on
calibration steps, a cache of codecs per setting, the step's metrics."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.channels import ChannelNormalized
from lightning_acgc.codecs.registry import build_codec
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.policies._schedule import is_calibration_step
from lightning_acgc.policies.base import Policy, Reduce
from lightning_acgc.policies.gradient_stats import GradientStats

__all__ = ["BROKEN_RETRIES", "MAX_RETRIES", "CalibratingPolicy"]

MAX_RETRIES = 16  # steps in a row that calibrate again after one that overflowed
# ... after one whose settings measured over their promise (acgc: global or per layer)
BROKEN_RETRIES = 3


class CalibratingPolicy(Policy):
    """Base of policies that read gradient statistics every ``calibrate_every`` steps
    (and on the first ``warmup_steps``). Subclasses set both attributes and ``config``."""

    calibrate_every: int
    warmup_steps: int
    config: CodecSpec

    def __init__(self) -> None:
        self.stats = GradientStats()
        self._codecs: dict[tuple, Codec] = {}
        self._calibrating = False
        self._metrics: dict[str, float] = {}
        self._step_grads: dict[str, torch.Tensor] | None = None  # set_step_gradients'
        self._retry_from: int | None = None  # the last step that calibrate_again named
        self._retries = 0  # in a row, up to it
        self._retry_limit = MAX_RETRIES  # the most in a row, set by calibrate_again

    def _codec(self, name: str, config_cls: type | None = None, **options: Any) -> Codec:
        """The codec ``name`` with ``options`` (built once, then reused). ``config_cls``:
        build the options as this config class (for settings only a policy may choose,
        e.g. :class:`~lightning_acgc.codecs.quant.QuantWidthConfig`'s widths)."""
        key = (name, *sorted(options.items()))
        codec = self._codecs.get(key)
        if codec is None:
            if config_cls is None:
                codec = CodecSpec(name, options, self.config.backend).build()
            else:
                codec = build_codec(name, config_cls(**options))
                codec.backend = self.config.backend  # type: ignore[attr-defined]
            self._codecs[key] = codec
        return codec

    def _norm_input(self, codec: Codec) -> Codec:
        """``codec`` on channel-normalized values, for a BatchNorm input (built once)."""
        key = ("channels", id(codec))
        wrapped = self._codecs.get(key)
        if wrapped is None:
            wrapped = self._codecs[key] = ChannelNormalized(codec)
        return wrapped

    def _bounded_for(self, key: str, bounds: dict[str, float], relative: float) -> Codec:
        """``bounded`` with the site's absolute bound, or with ``relative`` (a fraction of
        the tensor's range) for a site that has none yet. Needs ``self.group_size``."""
        bound = bounds.get(key)
        options = {"group_size": self.group_size}  # type: ignore[attr-defined]
        if bound is None:
            return self._codec("bounded", error_bound=relative, relative=True, **options)
        return self._codec("bounded", error_bound=bound, relative=False, **options)

    def describe(self, codec: Codec) -> str:
        if codec.name != "bounded":
            return super().describe(codec)
        cfg = codec.config
        return f"{'rel' if cfg.relative else 'eb'}={cfg.error_bound:.3g}"

    @property
    def measuring(self) -> bool:
        """Whether this step calibrates (the engine measures what it records for it)."""
        return self._calibrating

    def is_calibration_step(self, step: int) -> bool:
        return self._scheduled(step) or self.retries_at(step)

    def _scheduled(self, step: int) -> bool:
        return is_calibration_step(step, self.calibrate_every, self.warmup_steps)

    def retries_at(self, step: int) -> bool:
        """Whether ``step`` calibrates again after the step before it (:meth:`calibrate_again`)."""
        retry = self._retry_from is not None and self._retries <= self._retry_limit
        return retry and step == self._retry_from + 1

    def calibrate_again(self, step: int, limit: int = MAX_RETRIES) -> None:
        """Calibrate on the step after ``step`` too, up to ``limit`` steps in a row: where
        step ``step``'s calibration could not be read (its gradients overflowed: fp16's
        GradScaler skips such a step while it lowers its scale, often for the first steps
        of a fit), and where its settings measured over their promise (``BROKEN_RETRIES``:
        they would otherwise stay in force until the next scheduled calibration). The
        count starts again at each scheduled calibration (the warm-up's too)."""
        retried = step - 1 == self._retry_from and not self._scheduled(step)
        self._retries = self._retries + 1 if retried else 1
        self._retry_from = step
        self._retry_limit = limit

    def setup(self, model: nn.Module) -> None:
        self.stats.setup(model)

    def begin_step(self, step: int) -> None:
        self._calibrating = self.is_calibration_step(step)
        self._metrics = {}
        self._step_grads = None
        if self._calibrating:
            self.stats.start()

    def exact_pass(self, loss_scale: float = 1.0) -> contextlib.AbstractContextManager[None]:
        """Around each exact pass of the step's batches (the calibration cycle's, its loss
        scaled by ``loss_scale``): the statistics read those passes only, unscaled
        (:meth:`GradientStats.exact_pass`)."""
        return self.stats.exact_pass(loss_scale)

    def set_step_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        self._step_grads = grads  # (what end_step reads in place of p.grad)

    def set_loss_scale(self, scale: float) -> None:
        self.stats.loss_scale = scale  # (of the step's own pass: read without it)

    def _reduced_grad_sq(self, reduce: Reduce) -> dict[str, float]:
        """Stop gathering; squared output-gradient norms by module, averaged over ranks."""
        grad_sq = self.stats.stop()
        names = sorted(self.stats.fan_in.keys() | grad_sq.keys())
        vec = reduce(torch.tensor([grad_sq.get(n, 0.0) for n in names], dtype=torch.float64))
        return dict(zip(names, vec.tolist(), strict=True))

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def teardown(self) -> None:
        self.stats.stop()
