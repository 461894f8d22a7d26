"""acgc's noise-relative budget per layer: a layer whose gradient is noisy anyway gets a
looser bound (and fewer bits) than one whose gradient is nearly exact; without readings
of the batch's halves the budget falls back to a fixed error, never to the loosest."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_acgc.policies import build_policy
from tests._halves_runs import run_with_halves


class TwoBranches(nn.Module):
    """y ≈ a(x_a) + b(x_b): two weight ops with inputs of their own."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, 1, bias=False)
        self.b = nn.Linear(d, 1, bias=False)

    def forward(self, xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        return (self.a(xa) + self.b(xb)).squeeze(1)


def _fit(
    options: dict, steps: int = 6, batch: int = 1024, d: int = 16, halves: bool = True
) -> tuple[TwoBranches, object, list[dict]]:
    """Branch ``a`` starts at its optimum (its gradient is sampling noise alone), branch
    ``b`` far from it (its gradient is mostly signal)."""
    torch.manual_seed(0)
    wa, wb = torch.randn(d), torch.randn(d)
    model = TwoBranches(d)
    with torch.no_grad():
        model.a.weight.copy_(wa)
        model.b.weight.copy_(wb + 3 * torch.randn(d))
    policy = build_policy("acgc", calibrate_every=1, warmup_steps=1, **options)

    def losses(step: int):
        g = torch.Generator().manual_seed(step)
        xa, xb = torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)
        y = xa @ wa + xb @ wb + torch.randn(batch, generator=g)

        def loss(lo: int = 0, hi: int = batch) -> torch.Tensor:
            return (model(xa[lo:hi], xb[lo:hi]) - y[lo:hi]).square().mean()

        h = batch // 2
        return loss, ((lambda: loss(0, h)), (lambda: loss(h, batch))) if halves else None

    return model, policy, run_with_halves(model, policy, steps, losses)


def test_noisy_layer_gets_the_looser_bound() -> None:
    """a's bound relative to its gradient is far looser than b's. Both branches have the
    same sampling noise (the same δ, inputs alike), so the absolute error each may take,
    e_m·‖g_m‖ = ρ·‖noise_m‖, is the same, and so are their widths."""
    _, policy, history = _fit({"noise_ratio": 0.5})
    e = policy._layer_errors
    assert e["a"] > 4 * e["b"], e  # a's gradient is noise; b's is signal
    assert e["a"] == pytest.approx(min(policy.max_error, e["a"]))
    bits = policy.site_bits
    assert bits["a:0"] <= bits["b:0"], bits
    # every calibration keeps its promise: globally and per layer
    assert all(h["grad_error"] <= h["error_target"] for h in history)
    assert all(h["layer_budget_use"] <= 1.0 for h in history[1:]), history


def test_one_bound_for_every_layer_without_a_noise_budget() -> None:
    _, policy, _ = _fit({"gradient_error": 0.2})
    assert set(policy._layer_errors.values()) == {0.2}


@pytest.mark.parametrize(
    ("options", "expected"),
    [({"noise_ratio": 0.5}, 0.05), ({"noise_ratio": 0.5, "gradient_error": 0.3}, 0.3)],
)
def test_without_halves_the_budget_falls_back(options: dict, expected: float) -> None:
    _, policy, history = _fit(options, steps=3, halves=False)
    assert policy.error_target == expected
    assert "noise_error" not in history[-1]
    assert math.isclose(history[-1]["error_target"], expected)


def test_layer_noise_survives_a_checkpoint() -> None:
    _, policy, _ = _fit({"noise_ratio": 0.5}, steps=3)
    fresh = build_policy("acgc", noise_ratio=0.5, calibrate_every=1, warmup_steps=1)
    fresh.load_state_dict(policy.state_dict())
    assert list(fresh._layer_noise_sq) == list(policy._layer_noise_sq)
    layer_sq = {"a": 1.0, "b": 2.0}
    assert fresh.layer_errors(layer_sq) == policy.layer_errors(layer_sq)
    assert fresh.error_target == policy.error_target


def test_an_old_checkpoints_noise_total_still_loads() -> None:
    _, policy, _ = _fit({"noise_ratio": 0.5}, steps=2)
    state = policy.state_dict()
    totals = [sum(r.values()) for r in state.pop("layer_noise_sq")]
    fresh = build_policy("acgc", noise_ratio=0.5)
    fresh.load_state_dict({**state, "noise_sq": totals})
    fresh._update_target(sum(fresh._grad_sq) / len(fresh._grad_sq))
    assert fresh.error_target == pytest.approx(policy.error_target, rel=1e-6)


def test_noise_floor_loosens_only_the_noisy_layer() -> None:
    """With ``noise_floor`` ρ₀ each layer's bound is the looser of e and its noise budget:
    a (at its optimum: its gradient is sampling noise) gets ρ₀·noise/‖g_a‖ ≫ e, b (mostly
    signal, noise budget below e) keeps e. The global target is the looser one too, and
    every calibration's measured error stays within it."""
    e, rho = 0.05, 0.2
    _, policy, history = _fit({"gradient_error": e, "noise_floor": rho})
    errors = policy._layer_errors
    assert errors["b"] == e, errors
    assert errors["a"] > 4 * e, errors
    noise_a = sum(r["a"] for r in policy._layer_noise_sq) / len(policy._layer_noise_sq)
    for g_sq in (noise_a, noise_a / 1e6, noise_a * 1e6):  # the floor, capped, or e
        expected = max(e, min(rho * math.sqrt(noise_a / 4 / g_sq), policy.max_error))
        assert policy.layer_errors({"a": g_sq})["a"] == pytest.approx(expected)
    assert policy.error_target >= e
    assert all(h["grad_error"] <= h["error_target"] for h in history)
    plain = _fit({"gradient_error": e})[1]
    assert policy.site_bits["a:0"] < plain.site_bits["a:0"], (policy.site_bits, plain.site_bits)


def test_noise_floor_without_halves_keeps_gradient_error() -> None:
    _, policy, _ = _fit({"gradient_error": 0.05, "noise_floor": 0.2}, steps=3, halves=False)
    assert policy.error_target == 0.05
    assert set(policy._layer_errors.values()) == {0.05}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"noise_floor": 0}, "noise_floor=0 must be a number > 0 or None"),
        ({"noise_floor": True}, "noise_floor=True must be a number > 0 or None"),
        (
            {"noise_floor": 0.2, "noise_ratio": 0.5},
            "noise_floor=0.2 does not combine with noise_ratio=0.5: give one of them",
        ),
    ],
)
def test_noise_floor_rejects(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_policy("acgc", **options)
