"""acgc with the ``quant`` codec: the error model of stochastic rounding, the allocation
of widths, mixed widths through the engine, the calibration, the noise-relative budget."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

from lightning_acgc.codecs.quant import QuantCodec, QuantWidthConfig
from lightning_acgc.engine import ActivationCompressor, EngineSettings, compressed_step
from lightning_acgc.engine.meter import LOSS_HALF
from lightning_acgc.policies import ACGCPolicy, build_policy
from lightning_acgc.policies.bit_allocation import HALF, KEEP, LADDER, allocate_to_error
from lightning_acgc.policies.quant_error import sr_variance
from tests._halves_runs import run_with_halves
from tests.test_policies import _train


def _codec_error(x: torch.Tensor, bits: int) -> float:
    if bits == HALF:  # rounding to nearest: the same error for every seed
        return float((x.half().float() - x).double().square().mean())
    codec = QuantCodec(QuantWidthConfig(bits=bits, group_size=256))
    errs = [(codec.decode(codec.encode(x, seed=s)) - x).double().square().mean() for s in range(8)]
    return float(sum(errs) / len(errs))


def test_sr_variance_is_the_codecs_error() -> None:
    """The modelled per-element variance equals the codec's measured one at every width
    (``half``'s too), for signed tensors and for ReLU-like ones (zero-kept groups: zeros
    exact), which are never given 1 bit (their mask would not be kept)."""
    g = torch.Generator().manual_seed(0)
    signed = torch.randn(64, 512, generator=g) * torch.rand(64, 1, generator=g)
    relu = signed.relu()
    relu[:, :100] *= 5.0  # groups of different ranges
    for x in (signed, relu):
        model = sr_variance(x, 256, max_groups=10**9)
        for i, bits in enumerate(LADDER):
            if x is relu and bits == 1:
                assert math.isinf(float(model[i]))
                continue
            # half: one deterministic rounding, its mean ruled by the few largest values
            rel = 0.15 if bits == HALF else 0.05
            assert _codec_error(x, bits) == pytest.approx(float(model[i]), rel=rel), bits
    sampled = sr_variance(signed, 256, max_groups=32)  # a regular sample of the groups
    assert torch.allclose(sampled, sr_variance(signed, 256, max_groups=10**9), rtol=0.3)


def test_allocation_gives_more_bits_to_the_more_sensitive_tensor() -> None:
    v = [1.0 / (2**b - 1) ** 2 for b in LADDER]  # per-element variance at each width
    errors = [{b: c * x for b, x in zip(LADDER, v, strict=True)} for c in (1.0, 100.0)]
    widths = allocate_to_error([1000, 1000], errors, 1.0, [1, 1], [32, 32])
    assert widths[1] > widths[0], widths
    assert sum(errors[i][b] for i, b in enumerate(widths)) <= 1.0
    # per-layer minimum widths are kept; an unreachable budget keeps tensors raw
    assert allocate_to_error([10, 10], errors, 1.0, [8, 1], [32, 32])[0] == 8
    assert allocate_to_error([10, 10], errors, 0.0, [1, 1], [32, 32]) == [KEEP, KEEP]


def test_allocation_gives_back_an_upgrade_a_later_one_made_unneeded() -> None:
    """Greedy upgrades first the small tensor (more error cut per bit), then the large
    one, after which the small one's upgrade is not needed: it is given back."""
    small = {1: 1.0, 2: 0.5, 3: 0.3, 4: 0.1, 5: 0.06, 6: 0.03, 7: 0.02, 8: 0.01}
    large = {1: 3.0, 2: 0.2, 3: 0.1, 4: 0.01, 5: 0.008, 6: 0.005, 7: 0.002, 8: 0.001}
    widths = allocate_to_error([1, 10], [small, large], 2.0, [1, 1], [32, 32])
    assert widths == [1, 2]


def test_a_tensor_eight_bits_cannot_serve_takes_half_before_it_is_kept() -> None:
    """16 bits (the ``half`` codec) sit between 8 bits and keeping a tensor: a budget
    that 8 bits miss and float16 meets costs 16 bits a value, not 32."""
    v = [1.0 / (2**b - 1) ** 2 for b in LADDER[:-1]] + [1e-8]
    errors = [{b: x for b, x in zip(LADDER, v, strict=True)}]
    assert allocate_to_error([1000], errors, 1e-6, [1], [32], overhead=0.25) == [HALF]
    assert allocate_to_error([1000], errors, 1e-9, [1], [32], overhead=0.25) == [KEEP]
    assert allocate_to_error([1000], errors, 2e-5, [1], [32], overhead=0.25) == [8]


def test_one_bit_and_mixed_widths_round_trip_through_the_engine() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4)
    )
    x = torch.randn(64, 32)
    policy = ACGCPolicy(gradient_error=0.5, warmup_steps=1, calibrate_every=1000)
    engine = ActivationCompressor(
        policy, model=model, settings=EngineSettings(min_numel=0), keep_packed=True
    )
    engine.install()
    policy.setup(model)
    policy.site_bits = {"0:0": HALF, "1:0": 1, "3:0": 2, ":0": 8}  # 1:0, 3:0 shared by 2, 4
    try:
        model.zero_grad()
        compressed_step(engine, model, lambda: model(x).square().mean(), step=5)
        settings = {k: r.settings for k, r in engine.stats.sites.items()}
        assert settings["1:0"] == "bits=1" and settings["3:0"] == "bits=2", settings
        # the loss's square(), outside every module, is the engine's whatever its width
        assert engine.stats.sites[":0"].settings == LOSS_HALF, settings
        assert engine.stats.sites["0:0"].codec == "half", settings
        assert sorted({p.meta["bits"] for p in engine.packed_log if p.codec == "quant"}) == [
            1,
            2,
        ]
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    finally:
        engine.remove()


def _calibrated(model: nn.Module, x: torch.Tensor, e: float, steps: int) -> tuple:
    """acgc at ``e`` over ``steps`` calibration steps of ``model(x).square().mean()``:
    the policy and the last step's per-site records."""
    policy = ACGCPolicy(gradient_error=e, warmup_steps=steps, calibrate_every=1000)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    policy.setup(model)
    try:
        for step in range(steps):
            model.zero_grad()
            compressed_step(engine, model, lambda: model(x).square().mean(), step=step)
        return policy, dict(engine.stats.sites)
    finally:
        engine.remove()


def test_normalization_statistics_are_kept_out_of_the_allocation() -> None:
    """LayerNorm's saved mean and 1/σ (shape (..., 1)) are kept as they are and never
    given a width: at 1 bit (the allocation's choice at e = 0.3) they left the sweep's
    char-level transformer at +10% validation loss; kept, +1%, at a higher ratio."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
    policy, sites = _calibrated(model, torch.randn(8, 32, 16), 0.3, steps=3)
    stats = [k for k, r in sites.items() if k.startswith("1:") and r.shape[-1] == 1]
    assert len(stats) == 2, {k: r.shape for k, r in sites.items()}
    assert all(sites[k].codec == "kept" for k in stats)
    assert not set(stats) & (set(policy.site_bits) | set(policy._variances))
    assert sites["1:0"].codec in ("quant", "split")  # the input itself is compressed


def test_saturating_activations_keep_four_bits() -> None:
    """A tanh's saved output enters its backward as 1 − ŷ²: rounding biases it by the
    rounding variance, which the error model (a variance) does not see. At a loose e the
    allocation gave BERT's pooler tanh 1 bit; it is held at 4, the Linear inputs are not."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)
    )
    policy, _ = _calibrated(model, torch.randn(64, 16), 0.9, steps=4)
    assert policy.site_bits["1:0"] >= 4, policy.site_bits
    # the tanh output is 2:0 too; the ReLU's output (3:0, 4:0) is a Linear's input
    assert policy.site_bits["3:0"] < 4, policy.site_bits


class _FunctionalGate(nn.Module):
    """Saturating activations called as functions inside one module (an attention's
    F.softmax, a gate's torch.sigmoid): the site's module type is this class's name."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 256), nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        p = torch.softmax(h, dim=-1)  # saved for softmax's backward
        g = torch.sigmoid(h)  # saved for sigmoid's backward
        return self.out(p * 256 + g * torch.relu(h))


def test_saturating_functions_keep_four_bits_whatever_their_module() -> None:
    """F.softmax inside a custom attention module (every HuggingFace attention) escaped
    the floor by module type: quick BERT's probabilities went to 2 bits. The autograd
    node that made the saved tensor names it: softmax and sigmoid outputs keep 4 bits,
    a ReLU output in the same module does not need to."""
    torch.manual_seed(0)
    model = _FunctionalGate()
    policy, sites = _calibrated(model, torch.randn(64, 16), 0.9, steps=4)
    kinds = {k for k in policy.site_bits if sites[k].module_type == "_FunctionalGate"}
    assert len(policy._saturating) == 2, (policy._saturating, kinds)
    assert all(policy.site_bits[k] >= 4 for k in policy._saturating), policy.site_bits
    others = [k for k in kinds if k not in policy._saturating]
    assert others and min(policy.site_bits[k] for k in others) < 4, policy.site_bits


def test_saturating_sites_survive_a_checkpoint() -> None:
    """The floor is allocated before the resumed step's forward notes its tensors: the
    checkpoint carries the sites (an older one: those of a saturating module type)."""
    torch.manual_seed(0)
    policy, _ = _calibrated(_FunctionalGate(), torch.randn(64, 16), 0.9, steps=3)
    state = policy.state_dict()
    resumed = ACGCPolicy(gradient_error=0.9)
    resumed.load_state_dict(state)
    assert resumed._saturating == policy._saturating and len(resumed._saturating) == 2
    older = {k: v for k, v in state.items() if k != "saturating"}
    older["structure"] = {k: {**r, "module_type": "Softmax"} for k, r in state["structure"].items()}
    resumed.load_state_dict(older)
    assert resumed._saturating == set(state["structure"])


def _deep_mlp() -> nn.Module:
    torch.manual_seed(0)
    dims = [64, 384, 256, 512, 192, 320, 448, 256, 384, 10]
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(nn.Tanh() if i % 2 else nn.ReLU())
    return nn.Sequential(*layers)


def _digits(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g)


def _deep_mlp_errors(e: float) -> list[dict[str, float]]:
    _, history = _train(
        _deep_mlp(), "acgc", 8, _digits, lr=0.0, gradient_error=e, calibrate_every=1
    )
    return history


def test_an_error_of_zero_loosens_kappa_without_a_reading() -> None:
    """A calibration whose rounding did not reach the gradient (measured error exactly 0)
    halves κ and leaves no reading behind: the next real reading sets κ by itself. A
    clamped reading of 1e-3 held the mean down for the following calibrations, κ fell to
    3x under the real readings and the ResNet recipe at e = 0.01 broke a layer's budget
    by 1.5x."""
    policy = ACGCPolicy(gradient_error=0.01)
    policy._predicted = 1e-4
    assert policy._measure(g_sq=1.0, err_sq=0.0) == pytest.approx(0.5)
    assert policy.kappa == pytest.approx(0.25) and not policy._readings
    policy._predicted = 1e-3
    policy._measure(g_sq=1.0, err_sq=0.15e-3)  # the model is 1/0.15 too high
    assert policy.kappa == pytest.approx(0.15)


@pytest.mark.slow
def test_calibration_keeps_the_promise() -> None:
    """``gradient_error`` keeps its meaning on calibration steps; κ settles (both ways),
    and at a loose e the quant allocation compresses far more than at a tight one."""
    ratios = {}
    for e in (0.05, 0.3):
        history = _deep_mlp_errors(e)
        errors = [h["grad_error"] for h in history]
        assert max(errors) <= e, (e, errors)
        kappas = [h["kappa"] for h in history[4:]]
        assert max(kappas) / min(kappas) < 2.0, kappas  # settled
        ratios[e] = history[-1]["ratio"]
    # (1.56x with every tensor dense; the nonzero layout of the ReLU outputs saves more
    # at the wide codes of a tight e: 5.0x -> 5.9x at 0.05, 7.8x -> 8.8x at 0.3)
    assert ratios[0.3] > 1.4 * ratios[0.05], ratios


@pytest.mark.slow
def test_calibration_uses_a_share_of_the_budget() -> None:
    """Measured errors land in [0.25e, e] once κ has settled (with widths 1/2/4/8 only it
    spent about 0.1e at e=0.05: 8 -> 4 bits multiplies a tensor's error by 289).

    The issue's goal is [0.5e, e]; at the default margin it is not met on this MLP (with no
    margin it is: the next test): each tensor's width is the
    smallest that meets its weight op's own budget (0.5 of the per-layer aim 0.35e²),
    and one width step is 4.4x the variance, so the own errors land at 0.25-1x that
    budget and the measured error at 0.28-0.42e. (Before the loss's tensor was kept, its
    error filled the gap to 0.57-0.8e.)"""
    for e in (0.05, 0.3):
        errors = [h["grad_error"] for h in _deep_mlp_errors(e)]
        assert 0.25 * e <= max(errors[3:]) <= e, (e, errors)


@pytest.mark.parametrize("e", [0.05, 0.1])
def test_without_a_margin_calibration_converges_into_the_band(e: float) -> None:
    """κ follows the readings both ways, so the measured error settles where the aim puts
    it: with no margin (``target=1``) the settled calibrations of the MLP land in
    [0.5e, e] (median 0.57-0.59e over init seeds 0-2), at the default margin near a third
    of e. The default keeps its margin for the per-layer promise over whole fits (README:
    "How much of e a calibration uses"; ``benchmarks/margin.py``)."""
    medians = {}
    for target in (None, 1.0):
        options = {} if target is None else {"target": target}
        _, history = _train(
            _deep_mlp(), "acgc", 10, _digits, lr=0.0, gradient_error=e, calibrate_every=1,
            **options,
        )  # fmt: skip
        errors = [h["grad_error"] for h in history]
        assert max(errors) <= e, (target, errors)
        medians[target] = statistics.median(errors[3:])  # after κ's first readings
    assert 0.5 * e <= medians[1.0] <= e, medians
    assert medians[None] < 0.5 * e < medians[1.0], medians


def test_bounded_codec_stays_available() -> None:
    e = 0.1
    policy, history = _train(
        _deep_mlp(),
        "acgc",
        4,
        _digits,
        lr=0.0,
        gradient_error=e,
        calibrate_every=1,
        codec="bounded",
    )
    assert all(v.startswith("eb=") for v in policy.site_settings().values())
    assert all(h["grad_error"] <= e for h in history)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"codec": "mask"}, "codec"),
        ({"noise_ratio": 0}, "noise_ratio"),
        ({"layer_floor": 2}, "layer_floor"),
    ],
)
def test_bad_acgc_options(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_policy("acgc", **options)


def _regression(batch: int, d: int = 64, rho: float = 0.5, steps: int = 6) -> tuple[float, list]:
    """Linear regression y = x·w* + ε (x ~ N(0, I), ε ~ N(0, σ²)) at w = w* + u: the batch
    gradient of mean((x·w − y)²) has mean 2u and trace of covariance
    4((‖u‖² + σ²)·d + ‖u‖²)/B, so the noise-relative error is known in closed form."""
    torch.manual_seed(0)
    sigma = 1.0
    w_star = torch.randn(d)
    u = torch.randn(d)
    u /= u.norm()
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w_star + u)
    policy = build_policy("acgc", noise_ratio=rho, calibrate_every=1, warmup_steps=1)

    def losses(step: int):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(batch, d, generator=g)
        y = x @ w_star + sigma * torch.randn(batch, generator=g)

        def loss(a: int = 0, b: int = batch) -> torch.Tensor:
            return (model(x[a:b]).squeeze(1) - y[a:b]).square().mean()

        h = batch // 2
        return loss, ((lambda: loss(0, h)), (lambda: loss(h, batch)))

    history = run_with_halves(model, policy, steps, losses)
    trace = 4 * ((1 + sigma**2) * d + 1) / batch
    expected = rho * math.sqrt(trace / (4 + trace))  # ρ·sqrt(tr Var g)/sqrt(E‖g‖²)
    return expected, history


def test_noise_relative_budget_on_linear_regression() -> None:
    targets = {}
    for batch in (256, 1024):
        expected, history = _regression(batch)
        got = history[-1]["error_target"]
        assert got == pytest.approx(expected, rel=0.25), (batch, got, expected)
        assert all(h["grad_error"] <= h["error_target"] for h in history)
        targets[batch] = got
    assert targets[1024] < 0.7 * targets[256]  # tightens as the batch grows


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(64, 16, 8, 8).relu(),  # zero-kept groups
        lambda: torch.randn(5000) * 1e-39,  # subnormals
        lambda: torch.full((600,), 5.0),  # constant groups (step 0)
        lambda: torch.cat([torch.randn(900), torch.tensor([float("nan"), float("inf")])]),
        lambda: torch.randn(3000).relu() * 3e37,  # ranges near float32's max
    ],
    ids=["relu", "subnormal", "constant", "nonfinite", "huge"],
)
def test_sr_variance_compiled_sums_match_the_torch_loop(make, monkeypatch) -> None:
    """The compiled CPU sums (acgc_sr_variance) against the torch loop they replace."""
    from lightning_acgc.kernels.common.cpu_lib import cpu_library
    from lightning_acgc.policies import quant_error

    if cpu_library() is None:
        pytest.skip("no C compiler")
    x = make()
    fast = sr_variance(x, 64)
    monkeypatch.setattr(quant_error, "sr_variance_sums_cpu", lambda *args: None)
    slow = sr_variance(x, 64)
    # (a subnormal range makes 1/step overflow: NaN in both, which the allocation skips)
    assert torch.equal(fast.isinf(), slow.isinf()) and torch.equal(fast.isnan(), slow.isnan())
    finite = slow.isfinite()
    torch.testing.assert_close(fast[finite], slow[finite], rtol=1e-12, atol=0)
