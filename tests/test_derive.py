"""Activations' and LayerNorms' outputs remade at unpack from their saved input
(lightning_acgc.engine.derive), for policies that set ``derives_elementwise`` (acgc)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.derive import Origin, derivative_gain, derive_plan
from lightning_acgc.engine.meter import SiteRecord
from lightning_acgc.policies.error_model import tensor_sensitivities
from lightning_acgc.policies.fixed import FixedPolicy


class Deriving(FixedPolicy):
    """One codec everywhere (or nothing: every tensor kept), outputs derived."""

    derives_elementwise = True
    measuring = True

    def __init__(self, spec: CodecSpec | None) -> None:
        super().__init__(spec or CodecSpec("quant", {"bits": 8}))
        self.keep_all = spec is None

    def codec_for(self, site, x):
        return None if self.keep_all else super().codec_for(site, x)


ACTIVATIONS = {
    "gelu": nn.GELU(),
    "gelu_tanh": nn.GELU(approximate="tanh"),
    "silu": nn.SiLU(),
    "mish": nn.Mish(),
    "hardswish": nn.Hardswish(),
    "leaky_relu": nn.LeakyReLU(0.2),
    "softplus": nn.Softplus(beta=2.0, threshold=5.0),
    "elu": nn.ELU(alpha=0.7),
}


class Mlp(nn.Module):
    """Linear, activation, Linear on a 3-D input (the second Linear saves a 2-D view)."""

    def __init__(self, act: nn.Module, norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16) if norm else nn.Identity()
        self.a, self.act, self.b = nn.Linear(16, 64), act, nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(self.norm(x * 1.0))))  # x * 1: not a leaf


def _inputs(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 32, 16, generator=g) * 2).requires_grad_()


def _grads(model: nn.Module, x: torch.Tensor, policy=None):
    model.zero_grad()
    x.grad = None
    stats = None
    if policy is None:
        loss = model(x).square().mean()
    else:
        # the loss's square() saves outside the model: kept by a keep-all policy only
        # with compress_loss (by default the engine stores it as float16)
        keep = getattr(policy, "keep_all", False)
        with compress_activations(model=model, policy=policy, compress_loss=keep) as stats:
            loss = model(x).square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()], stats


def derived_matches_plain(
    model: nn.Module, x: torch.Tensor, rtol: float = 0, atol: float = 0, autocast: bool = False
):
    """Gradients with every input kept and outputs derived equal plain's (to the
    tolerances; ``autocast``: both under bf16 autocast); the compressed step's stats."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        plain, _ = _grads(model, x)
        derived, stats = _grads(model, x, Deriving(None))
    for a, b in zip(derived, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    return stats


def _saved_pair(model: Mlp, x: torch.Tensor, policy) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the activation's backward unpacks as its input, what the second Linear
    unpacks as its input), read through the graph's saved tensors."""
    with compress_activations(model=model, policy=policy):
        out = model(x)
    act_node = out.grad_fn
    while type(act_node).__name__ not in ("AddmmBackward0", "MmBackward0"):
        act_node = act_node.next_functions[0][0]
    y_hat = act_node._saved_mat1
    node = act_node.next_functions[1][0]  # the view of the activation's output
    while node is not None and not hasattr(node, "_saved_self"):
        node = node.next_functions[0][0]
    return node._saved_self, y_hat


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_kept_input_gives_plain_gradients_and_stores_no_output(name):
    torch.manual_seed(0)
    model, x = Mlp(ACTIVATIONS[name]), _inputs()
    stats = derived_matches_plain(model, x)
    rec = stats.sites["b:0"]
    assert rec.codec == "recomputed" and rec.packed_bytes == 0
    assert rec.settings.startswith(f"{ACTIVATIONS[name].__class__.__name__.lower()[:4]}")
    assert rec.derived_from == "act:0" and rec.raw_bytes == 4 * 32 * 64 * 4


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_derived_output_is_the_activation_of_the_decoded_input(name):
    torch.manual_seed(0)
    model, x = Mlp(ACTIVATIONS[name]), _inputs(1)
    x_hat, y_hat = _saved_pair(model, x, Deriving(CodecSpec("quant", {"bits": 4})))
    assert not torch.equal(x_hat, model.a(x).detach())  # the input was rounded
    expected = ACTIVATIONS[name](x_hat).reshape(-1, 64)
    torch.testing.assert_close(y_hat, expected, rtol=0, atol=0)


def test_layer_norm_output_is_remade_from_its_input_and_exact_statistics():
    torch.manual_seed(0)
    model, x = Mlp(nn.GELU(), norm=True), _inputs(2)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 2.0)
        model.norm.bias.uniform_(-1.0, 1.0)
    stats = derived_matches_plain(model, x, rtol=1e-5, atol=1e-6)
    rec = stats.sites["a:0"]
    assert rec.codec == "recomputed" and rec.derived_from == "norm:0"
    assert rec.settings == "layer_norm of norm:0"
    # the gain: mean (γ/σ)² over the rows and features
    rstd = 1 / (x.detach().var(-1, unbiased=False) + 1e-5).sqrt()
    gain = rstd.square().mean() * model.norm.weight.detach().square().mean()
    assert rec.gain == pytest.approx(float(gain), rel=1e-4)


def test_layer_norm_with_rounded_input():
    torch.manual_seed(0)
    model, x = Mlp(nn.Identity(), norm=True), _inputs(3)
    with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 4}))):
        h = model.norm(x * 1.0)
        out = model.a(h)
    ln_node = h.grad_fn
    x_hat, mean, rstd = ln_node._saved_input, ln_node._saved_result1, ln_node._saved_result2
    assert not torch.equal(x_hat, x.detach())
    w, b = model.norm.weight, model.norm.bias
    expected = ((x_hat - mean) * rstd * w + b).reshape(-1, 16).detach()
    y_hat = out.grad_fn.next_functions[0][0]._saved_mat1  # addmm's input view
    torch.testing.assert_close(y_hat, expected, rtol=1e-6, atol=1e-6)


def test_gain_is_the_mean_squared_derivative():
    assert derivative_gain(F.gelu, torch.zeros(10)) == pytest.approx(0.25)
    assert derivative_gain(F.gelu, torch.full((10,), 50.0)) == pytest.approx(1.0)
    assert derivative_gain(F.silu, torch.full((10,), -50.0)) == pytest.approx(0.0, abs=1e-12)
    x = torch.tensor([float("nan"), float("inf"), 0.0])  # only the finite values count
    assert derivative_gain(F.gelu, x) == pytest.approx(0.25)
    assert derivative_gain(F.gelu, torch.tensor([float("nan")])) == 1.0
    # measured by the engine on measuring steps
    torch.manual_seed(0)
    model, x = Mlp(nn.GELU()), _inputs()
    _, stats = _grads(model, x, Deriving(CodecSpec("quant", {"bits": 8})))
    h = model.a(x).detach()
    assert stats.sites["b:0"].gain == pytest.approx(derivative_gain(F.gelu, h), rel=1e-6)
    assert 0.2 < stats.sites["b:0"].gain < 0.9


def test_nan_and_inf_survive_the_derivation():
    model = Mlp(nn.SiLU())
    with torch.no_grad():
        model.a.weight.fill_(0.0)
        model.a.bias.copy_(torch.linspace(-3, 3, 64))
        model.a.bias[3] = float("nan")
        model.a.bias[5] = float("inf")
        model.a.bias[7] = float("-inf")
    x_hat, y_hat = _saved_pair(model, _inputs(), Deriving(CodecSpec("quant", {"bits": 8})))
    assert y_hat[:, 3].isnan().all() and x_hat[..., 3].isnan().all()
    assert (y_hat[:, 5] == float("inf")).all()
    assert y_hat[:, 7].isnan().all() == F.silu(torch.tensor(float("-inf"))).isnan()


def test_slice_views_of_the_output_are_placed():
    """The consumer saves a view at an offset of the (contiguous) output."""

    class Sliced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.gelu(self.a(x))
            return y[:, 8:40].t() @ y[:, 16:24]

    torch.manual_seed(0)
    model, x = Sliced(), _inputs()[0].detach().requires_grad_()
    stats = derived_matches_plain(model, x)
    # the GELU's input (the Linear's product), the GELU's output and its slice views
    assert [r.codec for r in stats.sites.values()].count("recomputed") == 3


def test_without_the_policy_flag_nothing_is_derived():
    torch.manual_seed(0)
    model, x = Mlp(nn.GELU(), norm=True), _inputs()
    _, stats = _grads(model, x, FixedPolicy(CodecSpec("quant", {"bits": 8})))
    assert all(r.codec != "recomputed" for r in stats.sites.values())
    _, stats = _grads(model, x, Deriving(CodecSpec("quant", {"bits": 8})))
    recomputed = {k for k, r in stats.sites.items() if r.codec == "recomputed"}
    assert recomputed == {"a:0", "act:0", "b:0"}  # LayerNorm, Linear a, GELU outputs


def test_an_unrelated_output_of_the_same_shape_is_not_derived():
    """The activation's input was never saved (no grad through it): kept as usual."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 8)
    h = torch.randn(32, 64)  # no grad: GELU saves nothing
    with compress_activations(model=lin, policy=Deriving(CodecSpec("quant", {"bits": 8}))) as st:
        out = lin(F.gelu(h))
    assert all(r.codec != "recomputed" for r in st.sites.values())
    out.sum().backward()


def assert_second_backward_and_freed_memory(model: nn.Module, x: torch.Tensor, policy) -> None:
    """A second backward through the retained graph gives the same gradients, and every
    held byte is released with the graph."""
    with compress_activations(model=model, policy=policy) as stats:
        loss = model(x).square().mean()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(model.parameters()))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    del loss
    assert stats.live_bytes == 0


def test_second_backward_and_freed_memory():
    torch.manual_seed(0)
    model, x = Mlp(nn.GELU(), norm=True), _inputs()
    assert_second_backward_and_freed_memory(model, x, Deriving(CodecSpec("quant", {"bits": 8})))


def _record(key, module, module_type, codec="recomputed", **extra) -> SiteRecord:
    r = SiteRecord(key, module, module_type, (8, 4), "float32", codec, "")
    for k, v in extra.items():
        setattr(r, k, v)
    return r


def test_sensitivity_of_a_derived_output_joins_its_input_times_the_gain():
    rec = _record

    records = {
        "act:0": rec("act:0", "act", "GELU", "quant"),
        "fc:0": rec("fc:0", "fc", "Linear", derived_from="act:0", gain=0.5),
        "fc2:0": rec("fc2:0", "fc2", "Linear", "recomputed", shared_with="fc:0"),
    }
    sens = tensor_sensitivities(records, {"act": 2.0, "fc": 3.0, "fc2": 5.0}, {"fc": 4, "fc2": 4})
    assert set(sens) == {"act:0"}
    s = sens["act:0"]
    assert s.weight_by_module == {"fc": 0.5 * 4 * 3.0, "fc2": 0.5 * 4 * 5.0}
    assert s.other == pytest.approx(4 * 2.0)  # the GELU's own: mean fan-in x its ‖δ‖²


def test_outputs_remade_from_one_input_add_their_errors_as_amplitudes():
    """q and k remade from one LayerNorm output carry images of one rounding error: their
    parts through δ add as (√c_q + √c_k)², the holder's own read as before."""
    rec = _record
    records = {
        "ln:0": rec("ln:0", "ln", "LayerNorm", "quant"),
        "attn:0": rec("attn:0", "attn", "Attention", derived_from="ln:0", gain=1.0),
        "attn:1": rec("attn:1", "attn", "Attention", derived_from="ln:0", gain=4.0),
    }
    sens = tensor_sensitivities(records, {"ln": 1.0, "attn": 2.0}, {"fc": 4})
    direct, q_part, k_part = 4 * 1.0, 4 * 2.0 * 1.0, 4 * 2.0 * 4.0
    assert sens["ln:0"].other == pytest.approx(direct + (q_part**0.5 + k_part**0.5) ** 2)
    # independent holders stay independent: k from another input
    records["attn:1"] = rec("attn:1", "attn", "Attention", derived_from="ln2:0", gain=4.0)
    records["ln2:0"] = rec("ln2:0", "ln2", "LayerNorm", "quant")
    sens = tensor_sensitivities(records, {"ln": 1.0, "ln2": 1.0, "attn": 2.0}, {"fc": 4})
    assert sens["ln:0"].other == pytest.approx(direct + q_part)
    assert sens["ln2:0"].other == pytest.approx(direct + k_part)


def test_derive_plan_needs_the_input_among_the_recent():
    x = torch.randn(4, 6, requires_grad=True)
    h = x * 2
    y = F.silu(h)
    assert derive_plan(y, [Origin.of(x)]) is None
    assert derive_plan(y.t().contiguous(), [Origin.of(h)]) is None  # not the output
    plan = derive_plan(y, [Origin.of(h), Origin.of(x)])
    assert plan is not None and plan.sources == (0,)
    z = torch.relu(h)  # relu saves its output: nothing to derive
    assert derive_plan(z, [Origin.of(h)]) is None


def test_a_chain_of_derivations_joins_the_first_input():
    """A GELU of a LayerNorm's output: the GELU's input is the LayerNorm's output
    (derived from the LayerNorm's input), and its output is derived from that."""
    rec = _record
    records = {
        "ln:0": rec("ln:0", "ln", "LayerNorm", "quant"),
        "act:0": rec("act:0", "act", "GELU", derived_from="ln:0", gain=2.0),
        "fc:0": rec("fc:0", "fc", "Linear", derived_from="act:0", gain=0.5),
    }
    sens = tensor_sensitivities(records, {"ln": 1.0, "act": 2.0, "fc": 3.0}, {"fc": 4})
    assert set(sens) == {"ln:0"}
    assert sens["ln:0"].weight_by_module == {"fc": 2.0 * 0.5 * 4 * 3.0}
    assert sens["ln:0"].other == pytest.approx(4 * 1.0 + 2.0 * 4 * 2.0)


def acgc_after_calibration(model: nn.Module, x: torch.Tensor, e: float = 0.1):
    """acgc(``e``) on ``model(x).square().mean()`` for its 4 warm-up calibrations: the
    last step's site records, the policy, and the last gradient's relative error against
    the exact one."""
    from lightning_acgc.engine import ActivationCompressor, EngineSettings
    from lightning_acgc.engine.step import compressed_step
    from lightning_acgc.policies.acgc import ACGCPolicy

    model.zero_grad()
    model(x).square().mean().backward()
    exact = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    policy = ACGCPolicy(gradient_error=e, warmup_steps=4, calibrate_every=1000)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    policy.setup(model)
    try:
        for step in range(4):
            model.zero_grad()
            compressed_step(engine, model, lambda: model(x).square().mean(), step=step)
        sites = dict(engine.stats.sites)
    finally:
        engine.remove()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return sites, policy, float((got - exact).norm() / exact.norm())


def test_acgc_derives_and_allocates_through_the_input():
    """acgc on LayerNorm -> GELU -> Linear: the LayerNorm's and the GELU's outputs are
    remade from the LayerNorm's input, which alone gets a width; the promise holds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
    sites, policy, error = acgc_after_calibration(model, torch.randn(32, 16, 16))
    assert sites["2:0"].codec == "recomputed" and sites["2:0"].derived_from == "1:0"
    assert sites["3:0"].codec == "recomputed" and sites["3:0"].derived_from == "2:0"
    assert 0 < sites["3:0"].gain < 1.5
    assert "1:0" in policy.site_bits and not {"2:0", "3:0"} & set(policy.site_bits)
    assert policy.metrics()["grad_error"] <= 0.1
    assert error <= 0.1
