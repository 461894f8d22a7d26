"""Noise-relative budget (``noise_ratio`` ρ): compression may add at most ρ² of the batch
gradient's sampling variance. On calibration steps the adapter computes the exact
gradients g1, g2 of the batch's two halves (:meth:`ACGCPolicy.set_noise_gradients`,
before :meth:`set_exact_gradients`); Var(g) ≈ ‖g1 − g2‖²/4, so the allowed relative
error is e_noise = ρ·‖g1 − g2‖/(2‖g‖) (both averaged over the last ``history``
readings). With ``gradient_error`` also given, the smaller of the two holds; with
``noise_ratio`` alone, e_noise (at most ``max_error``). Logged as ``error_target``.

The same holds per layer: module m's own allowed error is e_m = ρ·‖g1_m − g2_m‖/(2‖g_m‖)
(capped like e), so a layer whose gradient is noisy anyway takes more of the rounding
error and one whose gradient is nearly exact less. Adam divides each coordinate by its
second moment, which holds the sampling variance too, so error relative to a layer's
own noise is what its update sees. Until the first reading of the halves (and for a
batch that cannot be halved, such as a full graph) the budget is ``fallback_error``
(or ``gradient_error``), never looser.

Noise floor (``noise_floor`` ρ₀, with ``gradient_error`` e): the allowed error is the
looser of the two, max(e, ρ₀·‖g1 − g2‖/(2‖g‖)), globally and per layer (capped at
``max_error``). A relative e grows ever stricter as a fit converges: the mean gradient
shrinks while its sampling noise does not (the per-sample gradients cancel), and neither
does the compression error, which is noise too. On the ResNet recipe's 10-epoch fit
e = 0.05 ends at 1.9x. An error within ρ₀² of the sampling variance costs at most that
share of the batch (SGD's noise grows by 1 + ρ₀²), whatever ‖g‖ is; early in a fit, when
‖g‖ is large against its noise, e holds as before.
"""

from __future__ import annotations

import math
import time

import torch

from lightning_acgc.policies._acgc_stats import per_module_sq_diff, reduce_tables
from lightning_acgc.policies.base import Reduce

__all__ = ["NoiseBudget", "check_budget_options"]


def check_budget_options(
    gradient_error: float | None, noise_ratio: float | None, noise_floor: float | None
) -> None:
    """Raise ``ValueError`` for a bad ``gradient_error`` (not in (0, 1)), ``noise_ratio``
    or ``noise_floor`` (not > 0), or for a noise floor with ``noise_ratio`` (a floor
    loosens ``gradient_error``, which defaults to 0.05 without ``noise_ratio``).

    Example:
        >>> check_budget_options(0.05, None, 0.1)
        >>> check_budget_options(0.05, 0.5, 0.1)
        Traceback (most recent call last):
        ...
        ValueError: noise_floor=0.1 does not combine with noise_ratio=0.5: give one of them
    """
    if gradient_error is not None and (
        isinstance(gradient_error, bool)
        or not (isinstance(gradient_error, (int, float)) and 0 < gradient_error < 1)
    ):
        raise ValueError(f"gradient_error={gradient_error!r} must be a number in (0, 1)")
    for name, value in (("noise_ratio", noise_ratio), ("noise_floor", noise_floor)):
        if value is not None and (
            isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0)
        ):
            raise ValueError(f"{name}={value!r} must be a number > 0 or None")
    if noise_floor is not None and noise_ratio is not None:
        raise ValueError(
            f"noise_floor={noise_floor!r} does not combine with noise_ratio={noise_ratio!r}: "
            "give one of them"
        )


class NoiseBudget:
    """Mixin of :class:`~lightning_acgc.policies.acgc.ACGCPolicy`: this calibration's
    allowed error from ``gradient_error`` and/or ``noise_ratio``. Uses the policy's
    ``noise_ratio``, ``noise_floor``, ``gradient_error``, ``max_error``, ``fallback_error``,
    ``error_target``, ``_grad_sq``, ``_layer_noise_sq``, ``_pending_noise``,
    ``_calib_s``, ``_mark`` and ``_metrics``."""

    fallback_error = 0.05  # noise_ratio without a reading of the halves: this e holds

    @property
    def _noise_rho(self) -> float | None:
        """ρ of the noise budget in use: ``noise_ratio``, else ``noise_floor`` (or none)."""
        return self.noise_ratio if self.noise_ratio is not None else self.noise_floor

    def needs_noise_estimate(self, step: int) -> bool:
        """Whether the adapter should pass the gradients of the batch's two halves."""
        return self._noise_rho is not None and self.is_calibration_step(step)

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
        (table,) = reduce_tables(reduce, per_module_sq_diff(first, second))
        self._pending_noise = table
        self._calib_s += self._lap()

    @property
    def _cap(self) -> float:
        """The loosest error any budget allows: ``gradient_error``, or ``max_error`` with a
        noise floor or without ``gradient_error``."""
        if self.noise_floor is not None:
            return self.max_error
        return min(self.gradient_error or self.max_error, self.max_error)

    @property
    def _budget_grad_sq(self) -> float:
        """‖g‖² of the allocation's budget E = e²‖g‖², relative: sensitivities and layers'
        ‖g_m‖² are averaged over the last ``history`` calibrations each relative to its own
        step's ‖g‖² (averaged absolute, early steps' large δ met a late step's small ‖g‖:
        the ResNet recipe's calibration at step 200 of 220 allocated 16.9 bits a value and
        measured 0.006e; its fit ended at 1.9x, now 4.3x). The promise holds each step to
        its own ‖g‖ (a CNN batch at 0.28x the mean ‖g‖² measured 1.69e with settings made
        for the mean), so the budget is min(‖g‖²) · mean(1/‖g‖²) ≤ 1: tighter after a small
        ‖g‖, by at most ``history``. A noise budget's e is already relative to the mean: 1.

        Example:
            >>> from lightning_acgc.policies.acgc import ACGCPolicy
            >>> policy = ACGCPolicy(gradient_error=0.05)
            >>> policy._grad_sq.extend([4.0, 1.0])
            >>> policy._budget_grad_sq  # 1 · (1/4 + 1) / 2
            0.625
        """
        grad_sq = [g for g in self._grad_sq if g > 0]
        if self.noise_ratio is not None or not grad_sq:
            return 1.0
        return min(grad_sq) * sum(1 / g for g in grad_sq) / len(grad_sq)

    @property
    def _mean_grad_sq(self) -> float:
        """The mean absolute ‖g‖² of the recent calibrations (0.0 before the first)."""
        return sum(self._grad_sq) / len(self._grad_sq) if self._grad_sq else 0.0

    def _update_target(self, g_sq: float) -> None:
        """This calibration's allowed error e: ``gradient_error`` and/or the noise budget."""
        self._grad_sq.append(g_sq)
        rho = self._noise_rho
        if rho is None:
            return
        if self._pending_noise is not None:
            self._layer_noise_sq.append(self._pending_noise)
            self._pending_noise = None
        if not self._layer_noise_sq:
            self.error_target = self.gradient_error or self.fallback_error
            return
        mean_g = self._mean_grad_sq
        noise = sum(sum(r.values()) for r in self._layer_noise_sq) / len(self._layer_noise_sq)
        e_noise = rho * math.sqrt(noise / 4 / mean_g) if mean_g > 0 else 0.0
        self._metrics["noise_error"] = e_noise
        self.error_target = self._combine(min(e_noise, self._cap))

    def _combine(self, e_noise: float) -> float:
        """The allowed error given the noise budget's (capped) ``e_noise``: itself, or with
        a noise floor the looser of it and ``gradient_error``."""
        return e_noise if self.noise_floor is None else max(e_noise, self.gradient_error)

    def layer_errors(self, layer_sq: dict[str, float]) -> dict[str, float]:
        """Each module's allowed relative error e_m, given its mean squared gradient norm:
        the noise budget of its own gradient where there are readings of the halves
        (capped like e), else the model's e.

        Example:
            >>> from lightning_acgc.policies.acgc import ACGCPolicy
            >>> policy = ACGCPolicy(noise_ratio=0.5)
            >>> policy._layer_noise_sq.append({"fc": 4.0})
            >>> policy.layer_errors({"fc": 1.0, "head": 1.0})
            {'fc': 0.5, 'head': 0.05}
        """
        rho = self._noise_rho
        e = self.error_target if self.noise_floor is None else self.gradient_error
        if rho is None or not self._layer_noise_sq:
            return {m: self.error_target for m in layer_sq}
        readings = list(self._layer_noise_sq)
        out = {}
        for m, g in layer_sq.items():
            noise = sum(r.get(m, 0.0) for r in readings) / len(readings)
            e_m = rho * math.sqrt(noise / 4 / g) if g > 0 and noise > 0 else e
            out[m] = self._combine(min(e_m, self._cap))
        return out
