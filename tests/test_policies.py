"""Policies: their math against hand-computed cases, and their behaviour in training."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_acgc.engine import ActivationCompressor, EngineSettings, compressed_step
from lightning_acgc.engine.meter import SiteRecord
from lightning_acgc.policies import Policy, available_policies, build_policy
from lightning_acgc.policies.bit_allocation import allocate_bits
from lightning_acgc.policies.error_model import tensor_sensitivities
from lightning_acgc.policies.gradient_stats import GradientStats


# -- error model --------------------------------------------------------------------
def test_linear_weight_gradient_error_matches_closed_form() -> None:
    """E‖ΔgW‖² = σ²·in_features·‖δ‖² for a zero-mean input error of variance σ²."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 16, bias=False)
    x = torch.randn(256, 48)
    stats = GradientStats()
    stats.setup(lin)
    stats.start()
    out = lin(x)
    delta = torch.randn_like(out)
    out.backward(delta)
    grad_sq = stats.stop()
    assert set(grad_sq) == {""}  # the root module is named ""
    rec = SiteRecord(":0", "", "Linear", tuple(x.shape), "float32", "bounded", "")
    sens = tensor_sensitivities({":0": rec}, grad_sq, stats.fan_in)[":0"]
    assert sens.weight == pytest.approx(48 * delta.square().sum().item(), rel=1e-5)
    eb = 0.01
    errors = []
    for _ in range(200):
        noise = (torch.rand_like(x) * 2 - 1) * eb  # uniform in [-eb, eb]: variance eb²/3
        errors.append((delta.T @ noise).square().sum().item())
    measured = sum(errors) / len(errors)
    assert measured == pytest.approx(sens.weight * eb**2 / 3, rel=0.05)


def test_shared_tensor_sums_its_sites_sensitivities() -> None:
    records = {
        "relu:0": SiteRecord("relu:0", "relu", "ReLU", (4, 8), "float32", "bounded", ""),
        "fc:0": SiteRecord("fc:0", "fc", "Linear", (4, 8), "float32", "bounded", "shared"),
        "tiny:0": SiteRecord("tiny:0", "tiny", "X", (2,), "float32", "kept", "tiny"),
    }
    records["fc:0"].shared_with = "relu:0"
    sens = tensor_sensitivities(records, {"relu": 1.0, "fc": 2.0}, {"fc": 8})
    assert set(sens) == {"relu:0"}
    assert sens["relu:0"].weight == 16.0 and sens["relu:0"].other == 8.0


# -- bit allocation ---------------------------------------------------------------
def _objective(sizes, weights, bits):
    return sum(w / (2**b - 1) ** 2 for w, b in zip(weights, bits, strict=True))


@pytest.mark.parametrize("seed", range(6))
def test_greedy_allocation_respects_budget_and_is_near_optimal(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 50, (5,), generator=g).tolist()
    weights = (torch.rand(5, generator=g) * 100).tolist()
    budget = 2.5
    bits = allocate_bits(sizes, weights, budget)
    assert sum(n * b for n, b in zip(sizes, bits, strict=True)) <= budget * sum(sizes)
    feasible = [
        c
        for c in itertools.product((1, 2, 4, 8), repeat=5)
        if sum(n * b for n, b in zip(sizes, c, strict=True)) <= budget * sum(sizes)
    ]
    best = min(_objective(sizes, weights, c) for c in feasible)
    assert _objective(sizes, weights, bits) <= 2.0 * best


def test_allocation_gives_more_bits_to_heavier_tensors_and_fills_budget() -> None:
    sizes = [1000] * 20
    weights = [float(10**i) for i in range(20)]
    bits = allocate_bits(sizes, weights, 2.0)
    assert bits == sorted(bits)
    assert abs(sum(bits) / len(bits) - 2.0) <= 0.1


# -- policies in training ---------------------------------------------------------
class TwoBranch(nn.Module):
    """Two parallel conv branches; one's output is scaled up 100x before the head."""

    def __init__(self, scale: float = 100.0) -> None:
        super().__init__()
        self.a = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)
        )
        self.b = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)
        )
        self.scale = scale
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.a(x), self.scale * self.b(x)], dim=1)
        return self.head(h.mean(dim=(2, 3)))


def _train(model, policy, steps, make_batch, lr=0.05, **options):
    """``steps`` SGD steps of ``model`` under ``policy`` (a name, or a policy built
    already): the policy and each step's metrics, ratio and loss."""
    policy = policy if isinstance(policy, Policy) else build_policy(policy, **options)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=256))
    engine.install()
    policy.setup(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    try:
        for step in range(steps):
            x, y = make_batch(step)
            opt.zero_grad()
            loss = compressed_step(
                engine, model, lambda x=x, y=y: nn.functional.cross_entropy(model(x), y), step
            )
            history.append({**policy.metrics(), "ratio": engine.stats.ratio, "loss": loss.item()})
            opt.step()
    finally:
        engine.remove()
        policy.teardown()
    return policy, history


def _images(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    y = torch.randint(0, 4, (16,), generator=g)
    x = torch.randn(16, 3, 12, 12, generator=g) + y[:, None, None, None].float()
    return x, y


def test_gact_average_bits_and_sensitive_branch_gets_more_bits() -> None:
    torch.manual_seed(0)
    model = TwoBranch()
    policy, history = _train(model, "gact", 2, _images, lr=0.0, bits=2)
    assert abs(history[0]["avg_bits"] - 2.0) <= 0.1
    bits = policy.site_bits
    # Each branch's ReLU output (packed once, also the second conv's input): same shape,
    # 100x the output gradient in branch b.
    assert bits["b.1:0"] > bits["a.1:0"], bits


def test_policies_state_round_trip() -> None:
    torch.manual_seed(0)
    for name, options in [("acgc", {"gradient_error": 0.1}), ("gact", {"bits": 2}), ("comet", {})]:
        policy, _ = _train(TwoBranch(1.0), name, 2, _images, calibrate_every=1, **options)
        clone = build_policy(name, **options)
        clone.load_state_dict(policy.state_dict())
        assert clone.site_settings() == policy.site_settings() != {}


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("acgc", {"gradient_error": 0}, "gradient_error"),
        ("acgc", {"gradient_error": 1.5}, "gradient_error"),
        ("acgc", {"calibrate_every": 0}, "calibrate_every"),
        ("gact", {"bits": 9}, "bits"),
        ("gact", {"bits": 0.5}, "bits"),
        ("comet", {"relative_bound": 0}, "relative_bound"),
        ("division", {"residual_bits": 3}, "residual_bits"),
        ("nope", {}, r"policy='nope' is unknown; allowed values"),
    ],
)
def test_bad_policy_options(name: str, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_policy(name, **options)


def test_all_policies_registered() -> None:
    assert {"acgc", "gact", "division", "comet", "fixed", "off"} <= set(available_policies())


class SaturatedTanh(nn.Module):
    """A layer feeding a saturated tanh: its gradient is tiny (tanh' ≈ 0) and comes through
    the saved tanh output, where a small absolute error is a large relative one in
    1 − y². The global gradient error is dominated by the head, so only a per-layer
    check sees this layer's error."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 256)
        self.act = nn.Tanh()
        self.b = nn.Linear(256, 4)
        with torch.no_grad():
            self.a.weight.mul_(8.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


def _shifted(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    y = torch.randint(0, 4, (64,), generator=g)
    return torch.randn(64, 16, generator=g) + y[:, None].float(), y


@pytest.mark.parametrize(("codec", "settled"), [("bounded", 4), ("quant", 2)])
def test_acgc_holds_each_layers_error_not_only_the_global_one(codec: str, settled: int) -> None:
    """``settled``: the first calibration from which every layer holds e. With bounded
    the layer's error through δ raises λ; with quant it sets width floors on the tensors
    saved around the layer (acgc_floors), which loosen one step at a time."""
    torch.manual_seed(0)
    e = 0.05
    _, history = _train(
        SaturatedTanh(),
        "acgc",
        20,
        _shifted,
        lr=0.01,
        gradient_error=e,
        calibrate_every=2,
        codec=codec,
    )
    calibrations = {i: h for i, h in enumerate(history) if "grad_error" in h}
    # First allocated bounds (step 1): globally fine, the saturated layer far off.
    assert calibrations[1]["grad_error"] <= e < calibrations[1]["layer_grad_error"]
    if codec == "bounded":
        assert calibrations[1]["lambda"] > 1
    else:
        assert calibrations[1]["floors"] > 0
    later = [h for i, h in calibrations.items() if i >= settled]
    assert len(later) == (20 - settled) // 2
    assert all(h["layer_grad_error"] <= e and h["grad_error"] <= e for h in later), later


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("fixed", {"codec": "quant", "bits": 2}),
        ("fixed", {"codec": "bounded", "error_bound": 0.1}),
        ("gact", {"bits": 2}),
        ("division", {}),
        ("comet", {}),
        ("acgc", {"gradient_error": 0.3}),
    ],
)
def test_every_policy_keeps_normalization_statistics(name: str, options: dict) -> None:
    """BatchNorm's per-channel mean and 1/σ of 64 channels are large enough to be packed
    with other small tensors (``coalesce_min_numel``); at 2 bits they made the ResNet
    recipe's fixed 2-bit fit overflow to NaN (policies.fixed). The engine keeps them,
    and LayerNorm's per-row ones, as they are, whatever the policy."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Flatten(2), nn.Linear(64, 32), nn.LayerNorm(32), nn.Flatten(), nn.Linear(64 * 32, 4),
    )  # fmt: skip
    policy = build_policy(name, **options)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings())
    engine.install()
    policy.setup(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    try:
        for step in range(2):
            compressed_step(engine, model, lambda: nn.functional.cross_entropy(model(x), y), step)
    finally:
        engine.remove()
        policy.teardown()
    sites = engine.stats.sites
    bn_stats = [k for k, r in sites.items() if k.startswith("1:") and tuple(r.shape) == (64,)]
    ln_stats = [k for k, r in sites.items() if k.startswith("5:") and r.shape[-1] == 1]
    assert len(bn_stats) == 2 and len(ln_stats) == 2, {k: r.shape for k, r in sites.items()}
    assert all(sites[k].settings == "norm statistic" for k in bn_stats + ln_stats), {
        k: (sites[k].codec, sites[k].settings) for k in bn_stats + ln_stats
    }
    assert sites["1:0"].codec != "kept"  # the BatchNorm input itself is compressed


@pytest.mark.parametrize("name", ["fixed", "gact", "acgc"])
def test_every_policy_keeps_group_norm_statistics(name: str) -> None:
    """GroupNorm saves its mean and 1/σ per sample and group, (N, G): 2048 values at
    batch 64 with 32 groups, compressed by every policy before (fixed 2-bit: 4% of the
    gradient off); kept as they are now, the input compressed."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3), nn.GroupNorm(32, 64), nn.ReLU(), nn.Conv2d(64, 8, 3)
    )  # fmt: skip
    x = torch.randn(64, 3, 10, 10)
    options = {"fixed": {"codec": "quant", "bits": 2}, "gact": {}, "acgc": {}}[name]
    policy = build_policy(name, **options)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    policy.setup(model)
    try:
        for step in range(2):
            compressed_step(engine, model, lambda: model(x).square().mean(), step)
    finally:
        engine.remove()
        policy.teardown()
    sites = engine.stats.sites
    stats = [k for k, r in sites.items() if k.startswith("1:") and tuple(r.shape) == (64, 32)]
    assert len(stats) == 2 and all(sites[k].settings == "norm statistic" for k in stats)
    assert sites["1:0"].codec not in ("kept", "recomputed")
