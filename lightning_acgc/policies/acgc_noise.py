"""Noise-relative budget (``noise_ratio`` ρ): compression may add at most ρ² of the batch
gradient's sampling variance. On calibration steps the adapter computes the exact
gradients g1, g2 of the batch's two halves (:meth:`ACGCPolicy.set_noise_gradients`,
before :meth:`set_exact_gradients`); Var(g) ≈ ‖g1 − g2‖²/4, so the allowed relative
error is e_noise = ρ·‖g1 − g2‖/(2‖g‖) (both averaged over the last ``history``
readings). With ``gradient_error`` also given, the smaller of the two holds; with
``noise_ratio`` alone, e_noise (at most ``max_error``). Logged as ``error_target``.
"""

from __future__ import annotations

import math
import time

import torch

from lightning_acgc.policies._acgc_stats import diff_sq, reduce_tables
from lightning_acgc.policies.base import Reduce

__all__ = ["NoiseBudget"]


class NoiseBudget:
    """Mixin of :class:`~lightning_acgc.policies.acgc.ACGCPolicy`: this calibration's
    allowed error from ``gradient_error`` and/or ``noise_ratio``. Uses the policy's
    ``noise_ratio``, ``gradient_error``, ``max_error``, ``error_target``, ``_grad_sq``,
    ``_noise_sq``, ``_pending_noise``, ``_calib_s``, ``_mark`` and ``_metrics``."""

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
