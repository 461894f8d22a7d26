"""acgc's per-layer promise is read against the larger of a module's ‖g_m‖² on the step
and its mean over the recent calibrations (``ModelCorrections.layer_scale``)."""

from __future__ import annotations

import math
from collections import deque

from lightning_acgc.policies import ACGCPolicy

E = 0.1


def _verified(grad_now: float, err: float, earlier: list[float]) -> ACGCPolicy:
    """A verified calibration of one module ``fc`` (the whole model): its ‖g_m‖² of the
    ``earlier`` calibrations, then ``grad_now`` on this one, measured error ``err``."""
    policy = ACGCPolicy(gradient_error=E)
    policy._norm_params = ["fc"]  # a module with a correction μ_m of its own
    policy._predicted = err  # the settings in force were allocated (κ unchanged)
    policy._predicted_own = {"fc": err}
    for g in [*earlier, grad_now]:  # absolute ‖g‖², each relative reading of fc is 1
        policy._grad_sq.append(g)
        policy._layer_grad_sq.append({"fc": 1.0})
    policy._measure_layers({"fc": grad_now}, {"fc": err}, g_sq=grad_now)
    return policy


def test_a_step_whose_gradient_dips_is_held_to_the_recent_mean() -> None:
    """‖g_m‖² 100x below the mean of the window: an error 1.5e of this step's gradient is
    0.26e of the scale Adam divides by; the promise holds and nothing tightens."""
    earlier = [1.0, 1.0]
    now = 0.01
    err = (1.5 * E) ** 2 * now
    policy = _verified(now, err, earlier)
    metrics = policy.metrics()
    assert math.isclose(metrics["layer_step_use"], 1.5)
    mean = (sum(earlier) + now) / 3
    assert math.isclose(metrics["layer_budget_use"], math.sqrt(err / (E**2 * mean)))
    assert metrics["layer_budget_use"] < 1
    assert policy._own_readings["fc"][-1] == 1.0  # μ_m did not tighten
    assert "fc" not in policy._violated


def test_a_step_whose_gradient_spikes_is_held_to_its_own() -> None:
    """‖g_m‖² 100x above the earlier readings: the window's mean is below it, so the
    step's own gradient is the scale (an error 1.5e of it breaks the promise)."""
    now = 100.0
    err = (1.5 * E) ** 2 * now
    policy = _verified(now, err, earlier=[1.0, 1.0])
    metrics = policy.metrics()
    assert math.isclose(metrics["layer_budget_use"], 1.5)
    assert math.isclose(metrics["layer_step_use"], 1.5)
    assert policy.worst_layer == "fc"
    assert policy._own_readings["fc"][-1] > 1.0  # μ_m tightened


def test_layer_scale_pairs_the_latest_readings() -> None:
    """Relative readings times the ‖g‖² of their own calibration, newest with newest
    (a window shorter in one of the two, e.g. the first calibration's ‖g‖² alone)."""
    policy = ACGCPolicy(gradient_error=E)
    policy._grad_sq = deque([8.0, 2.0, 4.0], maxlen=3)
    policy._layer_grad_sq = deque([{"fc": 0.5}, {"fc": 0.25}], maxlen=3)
    assert policy.layer_scale({"fc": 0.1}) == {"fc": (0.5 * 2.0 + 0.25 * 4.0) / 2}
    assert ACGCPolicy().layer_scale({"fc": 0.1}) == {"fc": 0.1}  # no readings yet
