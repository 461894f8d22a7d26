"""acgc's quant allocation: whole widths, then the shares one bit narrower (``split``)."""

from __future__ import annotations

import math
from collections import deque

import pytest
import torch
from torch import nn

from lightning_acgc.engine import ActivationCompressor, EngineSettings, compressed_step
from lightning_acgc.policies import ACGCPolicy
from lightning_acgc.policies.acgc_allocation import (
    SPLIT_OWN_FILL,
    held_layer_sq,
    quant_allocation,
)
from lightning_acgc.policies.bit_allocation import LADDER


def _table(scale: float) -> list[float]:
    """Per-element variance at each width of ``LADDER`` (about 4x per bit)."""
    return [scale / (2**b - 1) ** 2 for b in LADDER]


def _allocate(e_sq: float, layer_sq: dict[str, float], floors: dict | None = None):
    """Two weight ops' inputs, ``a`` sensitive and ``b`` not, and one other-ops tensor."""
    sens = {"a:0": (1000, {"a": 4.0}, 0.0), "b:0": (1000, {"b": 1.0}, 0.0), "c:0": (500, {}, 2.0)}
    variances = {k: _table(1.0) for k in sens}
    args = (lambda k: 1.0, lambda m: 1.0, 0.5, {}, 0.125, floors)
    return sens, variances, quant_allocation(sens, variances, layer_sq, 1.0, e_sq, *args)


def _modelled(sens, variances, widths, shares) -> tuple[float, dict[str, float]]:
    """Total modelled error and each weight op's own part, under widths and shares."""
    total, own = 0.0, {}
    for k, (_, weights, other) in sens.items():
        i = LADDER.index(widths[k])
        f = shares.get(k, 0.0)
        v = (1 - f) * variances[k][i] + f * (variances[k][i - 1] if f else 0.0)
        total += (sum(weights.values()) + other) * v
        for m, c in weights.items():
            own[m] = own.get(m, 0.0) + c * v
    return total, own


@pytest.mark.parametrize("e_sq", [1e-4, 1e-3, 1e-2])
def test_shares_use_the_room_the_whole_widths_leave_and_keep_every_budget(e_sq: float) -> None:
    layer_sq = {"a": 0.6, "b": 0.4}
    sens, variances, (widths, shares) = _allocate(e_sq, layer_sq)
    total, own = _modelled(sens, variances, widths, shares)
    assert total <= e_sq * (1 + 1e-9)
    for m, g in layer_sq.items():  # each op's own input within its share of its budget
        assert own[m] <= 0.5 * e_sq * g * (1 + 1e-9), (m, own[m], widths, shares)
        if shares.get(f"{m}:0"):  # and a split fills at most SPLIT_OWN_FILL of it
            assert own[m] <= SPLIT_OWN_FILL * 0.5 * e_sq * g * (1 + 1e-9), (m, shares)
    assert shares and all(0 < f <= 1 and f * 16 == int(f * 16) for f in shares.values())
    whole, _ = _modelled(sens, variances, widths, {})
    assert total > whole  # the budget left by the whole widths is used
    # and the more sensitive input keeps more bits a value
    assert widths["a:0"] - shares.get("a:0", 0) > widths["b:0"] - shares.get("b:0", 0)


def test_no_share_goes_below_a_floor() -> None:
    _, _, (widths, _) = _allocate(1e-3, {"a": 0.6, "b": 0.4})
    floors = {k: w for k, w in widths.items()}
    _, _, (floored, shares) = _allocate(1e-3, {"a": 0.6, "b": 0.4}, floors)
    assert floored == widths and not shares


def test_split_settings_reach_the_engine_and_their_error_is_modelled() -> None:
    """A calibrated model stores some tensors with the ``split`` codec; the settings table
    reads their mean width, and the policy's modelled variance mixes the two widths."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))  # fmt: skip
    policy = ACGCPolicy(gradient_error=0.3, calibrate_every=1)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings())
    engine.install()
    policy.setup(model)
    x = torch.randn(64, 32)
    try:
        for step in range(4):
            model.zero_grad()
            compressed_step(engine, model, lambda: model(x).square().mean(), step=step)
    finally:
        engine.remove()
        policy.teardown()
    assert policy.site_split, policy.site_settings()
    key, share = next(iter(policy.site_split.items()))
    bits = policy.site_bits[key]
    assert policy.site_settings()[key] == f"bits={bits - share:g}"
    table = policy._variances[key]
    i = LADDER.index(bits)
    assert math.isclose(policy._variance(key), (1 - share) * table[i] + share * table[i - 1])
    codecs = {r.codec for r in engine.stats.sites.values()}
    codec = policy.quant_codec(key, bits, share)  # split, or nonzero for a ReLU output
    assert codec.name in ("split", "nonzero") and codec.config.low_share == share
    assert codec.name in codecs, codecs


def test_held_budget_keeps_the_latest_reading_within_its_own_gradient() -> None:
    """A load fitted to the held ‖g_m‖² (times the mean load's scale) stays within the
    latest reading's own ‖g_m‖², also where its ‖g_m‖² was small for its load; it is the
    mean where the ratio did not move, and never above the mean."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        g = (torch.rand(3, generator=gen) + 0.01).tolist()
        c = (torch.rand(3, generator=gen) + 0.01).tolist()
        mean, held = held_layer_sq([{"fc": x} for x in g], {"fc": sum(c) / 3}, {"fc": c[-1]})
        assert mean["fc"] == pytest.approx(sum(g) / 3)
        assert held["fc"] <= mean["fc"] * (1 + 1e-12)
        per_load = held["fc"] / (sum(c) / 3)  # settings whose error on the mean load fits
        assert c[-1] * per_load <= g[-1] * (1 + 1e-9)
    steady = held_layer_sq([{"fc": 2.0}, {"fc": 4.0}], {"fc": 1.5}, {"fc": 2.0})
    assert steady[1]["fc"] == pytest.approx(3.0)


def test_held_budget_without_loads_or_for_unloaded_modules_is_the_mean() -> None:
    grad_sq = [{"fc": 3.0, "emb": 3.0}, {"fc": 1.0, "emb": 1.0}]
    assert held_layer_sq(grad_sq, {}, {}) == ({"fc": 2.0, "emb": 2.0}, {"fc": 2.0, "emb": 2.0})
    _, held = held_layer_sq(grad_sq, {"fc": 1.0}, {"fc": 1.0})
    assert held == {"fc": 1.0, "emb": 2.0}


def test_acgc_budget_follows_a_small_layer_gradient_of_the_latest_calibration() -> None:
    """A layer whose ‖g_m‖² fell 8x against its load on the latest calibration is held
    to that reading: its own input gets more bits than with three equal readings."""

    def allocate(last_g: float) -> int:
        policy = ACGCPolicy(gradient_error=0.1, probes=0)
        policy._readings.append(1.0)
        policy._variances["fc:0"] = [4.0**-b for b in LADDER]
        policy._raw_bits["fc:0"] = 32
        for g in (1.0, 1.0, last_g):
            policy._sens.setdefault("fc:0", deque(maxlen=3)).append((4096, {"fc": 1.0}, 0.0))
            policy._layer_grad_sq.append({"fc": g})
            policy._grad_sq.append(1.0)
        policy._allocate()
        return policy.site_bits["fc:0"]

    assert allocate(1 / 8) > allocate(1.0)
