"""Linear outputs (an attention's q, k, v after the head split; a feed-forward's
pre-activation) remade at unpack from the Linear's saved input
(lightning_acgc.engine.derive_linear), for policies that derive outputs (acgc)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine import recompute
from lightning_acgc.engine.derive import Origin, derive_plan
from lightning_acgc.engine.derive_linear import linear_gain, linear_output, made_by_linear
from tests.test_derive import (
    Deriving,
    acgc_after_calibration,
    assert_second_backward_and_freed_memory,
    derived_matches_plain,
)


class Attention(nn.Module):
    """Self-attention as BERT writes it: q, k, v Linears on a 3-D input, heads split by
    view and transpose (or permute), ``q·kᵀ``, softmax, ``p·v``."""

    def __init__(self, dim: int = 16, heads: int = 2, bias: bool = True, permute: bool = False):
        super().__init__()
        self.heads, self.permute = heads, permute
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=bias) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def split(self, y: torch.Tensor) -> torch.Tensor:
        b, s, d = y.shape
        y = y.view(b, s, self.heads, d // self.heads)
        return y.permute(0, 2, 1, 3) if self.permute else y.transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0  # not a leaf
        q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
        p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        ctx = (p @ v).transpose(1, 2).reshape(x.shape)
        return self.out(ctx)


def _x(seed: int = 0, shape: tuple[int, ...] = (4, 8, 16)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_()


def _grads(model: nn.Module, x: torch.Tensor, policy=None):
    model.zero_grad()
    x.grad = None
    if policy is None:
        model(x).square().mean().backward()
        stats = None
    else:
        with compress_activations(model=model, policy=policy, compress_loss=True) as stats:
            loss = model(x).square().mean()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()], stats


def _linear_of(stats) -> dict[str, str]:
    """The sites remade as Linear products, each with the site of the input."""
    return {
        k: r.derived_from
        for k, r in stats.sites.items()
        if r.codec == "recomputed" and r.settings.startswith("linear")
    }


@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_kept_input_gives_plain_gradients_and_stores_no_query_key_value(bias, permute):
    torch.manual_seed(0)
    model, x = Attention(bias=bias, permute=permute), _x()
    plain, _ = _grads(model, x)
    got, stats = _grads(model, x, Deriving(None))
    for a, b in zip(plain, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # q and kᵀ (saved by q·kᵀ), v (saved by p·v): each from its Linear's input (k's and
    # v's inputs share q's holder); the loss's (compress_loss) from out's input
    derived = _linear_of(stats)
    assert sorted(derived.values()) == ["out:0", "q:0", "q:0", "q:0"]
    assert all(stats.sites[k].packed_bytes == 0 for k in derived)


def test_derived_query_is_the_product_of_the_decoded_input():
    """With the input rounded to 8 bits, the remade tensors are the Linears of the
    rounded input: gradients close to plain's, within the rounding's reach."""
    torch.manual_seed(0)
    model, x = Attention(), _x()
    plain, _ = _grads(model, x)
    got, stats = _grads(model, x, Deriving(CodecSpec("quant", {"bits": 8})))
    assert len(_linear_of(stats)) == 4
    flat_plain = torch.cat([g.reshape(-1) for g in plain])
    flat_got = torch.cat([g.reshape(-1) for g in got])
    assert (flat_got - flat_plain).norm() <= 0.05 * flat_plain.norm()


def test_plan_replays_view_transpose_and_copy():
    lin = nn.Linear(8, 6)
    flat = torch.randn(10, 8, requires_grad=True) * 1.0
    y = lin(flat).view(2, 5, 3, 2).permute(0, 2, 3, 1).transpose(-1, -2).reshape(6, 5, 2)
    plan = linear_output(y, y, [Origin.of(torch.zeros(3)), Origin.of(flat)])
    assert plan is not None and plan.sources == (1,) and plan.name == "linear"
    assert torch.equal(plan.fn(flat.detach()), y.detach())
    assert plan.gain(None) == pytest.approx(linear_gain(lin.weight))


def test_a_dense_layer_with_an_in_out_weight_is_remade() -> None:
    """Hugging Face's Conv1D (GPT-2's dense layer): ``addmm(b, x, W)`` with W (in, out)
    used as it is, no transpose; its output remade as nn.Linear's, the same gain."""
    from transformers.pytorch_utils import Conv1D

    dense = Conv1D(nf=6, nx=8)
    x = torch.randn(10, 8, requires_grad=True) * 1.0
    y = torch.addmm(dense.bias, x, dense.weight).view(10, 3, 2).transpose(0, 1)  # as forward
    plan = linear_output(y, y._base, [Origin.of(x)])  # (a view of the product)
    assert plan is not None and plan.name == "linear"
    torch.testing.assert_close(plan.fn(x.detach()), y.detach())
    assert plan.gain(None) == pytest.approx(linear_gain(dense.weight.t()))
    w = dense.weight * 1.0  # computed: not remade
    z = torch.addmm(dense.bias, x, w)
    assert linear_output(z, z, [Origin.of(x)]) is None


def _cache(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape) if shape else torch.tensor([])  # () : a 1-D empty cache


@pytest.mark.parametrize(
    ("cache", "remade"), [((), True), ((2, 3, 0, 2), True), ((2, 3, 4, 2), False)]
)
def test_keys_concatenated_with_an_empty_cache_are_remade(cache, remade) -> None:
    """A Hugging Face KV cache's first update, ``cat([cache, k], dim=-2)``: with an
    empty cache the result is k's values, remade as the product's; with cached keys
    it holds values no product made, and is not."""
    lin = nn.Linear(8, 6)
    x = torch.randn(10, 8, requires_grad=True) * 1.0
    k = lin(x).view(2, 5, 3, 2).transpose(1, 2)
    t = torch.cat([_cache(cache), k], dim=-2)
    saved = t.transpose(-1, -2)  # as q·kᵀ saves it
    plan = derive_plan(saved, [Origin.of(x)])
    assert (plan is not None) == remade
    if remade:
        assert torch.equal(plan.fn(x.detach()), saved.detach())


def test_a_concatenation_is_remade_only_where_the_sizes_tell_its_parts_empty() -> None:
    """The sizes after a concatenation (the saved tensor's, those a select, view or
    expand recorded) hold a cached part's rows, which the product's shape does not; an
    expand before it could make those rows from one, and is refused."""
    lin = nn.Linear(8, 6)
    x = torch.randn(10, 8, requires_grad=True) * 1.0
    y = lin(x)
    for cached in (0, 4):
        for t in (
            torch.cat([torch.zeros(cached, 6), y]).t(),
            torch.cat([torch.zeros(cached, 6), y])[2].clone(),  # a select step, then a copy
            torch.cat([torch.zeros(cached, 6), y]).unsqueeze(0).expand(3, -1, -1).clone(),
        ):
            plan = derive_plan(t, [Origin.of(x)])
            assert (plan is not None) == (cached == 0)
            if plan is not None:
                assert torch.equal(plan.fn(x.detach()), t.detach())
    broadcast = torch.cat([torch.zeros(2, 6), y[:1].expand(3, 6)])
    assert derive_plan(broadcast, [Origin.of(x)]) is None
    assert derive_plan(torch.cat([y, y]), [Origin.of(x)]) is None  # two parts with history


def test_a_copy_of_a_slice_at_an_offset_is_remade_from_there() -> None:
    """A clone of a contiguous slice that starts into the product: replayed, the clone
    of the slice is the slice itself (no copy), which starts into its storage too."""
    lin = nn.Linear(8, 6)
    x = torch.randn(10, 8, requires_grad=True) * 1.0
    y = lin(x)
    for t in (y[2:4].clone(), y.view(2, 5, 6)[1].clone(), y.view(2, 5, 6).unbind(0)[1].clone()):
        plan = derive_plan(t, [Origin.of(x)])
        assert plan is not None and torch.equal(plan.fn(x.detach()), t.detach())


def test_a_view_at_an_offset_of_the_product_is_placed():
    lin = nn.Linear(8, 12)
    x = torch.randn(10, 8, requires_grad=True) * 1.0
    y = lin(x)
    part = y[:, 4:9]
    plan = derive_plan(part, [Origin.of(x)])
    assert plan is not None and torch.equal(plan.fn(x.detach()), part.detach())


def test_not_derived_without_the_input_a_parameter_or_a_graded_bias():
    lin = nn.Linear(8, 4)
    x = torch.randn(10, 8, requires_grad=True) * 1.0
    y = lin(x)
    assert made_by_linear(y)
    assert linear_output(y, y, []) is None  # the input was not saved
    assert linear_output(y, y, [Origin.of(torch.randn(10, 8, requires_grad=True) * 1.0)]) is None
    lin.bias.requires_grad_(False)  # added by addmm, but no edge to read it from
    assert linear_output(lin(x), lin(x), [Origin.of(x)]) is None
    lin.bias.requires_grad_(True)
    w = lin.weight * 1.0  # a computed weight (a cast, a reparametrization)
    z = F.linear(x, w, lin.bias)
    assert linear_output(z, z, [Origin.of(x)]) is None
    scaled = lin(x) * 2.0  # another op after the product
    assert not made_by_linear(scaled)


def test_a_bias_changed_in_place_before_backward_is_an_error():
    """Autograd checks the weight (the product saved it); the bias only the remaking
    reads: changed in place, backward stops with a clear error instead of a wrong q."""
    torch.manual_seed(0)
    model, x = Attention(), _x()
    with compress_activations(model=model, policy=Deriving(None)):
        loss = model(x).square().mean()
    with torch.no_grad():
        model.q.bias.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
        loss.backward()


def test_gain_is_the_variance_factor_of_independent_errors():
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 0.3
    delta = torch.randn(20000, 64) * 0.01
    measured = float((delta @ w.t()).var() / delta.var())
    assert linear_gain(w) == pytest.approx(measured, rel=0.05)
    assert linear_gain(w, alpha=2.0) == pytest.approx(4 * linear_gain(w))


def test_nan_and_inf_in_the_input_reach_the_remade_product():
    """A NaN and an inf in the Linears' input: the remade q, k, v carry them as the
    forward's did, so the gradients' non-finite values sit where plain's do."""
    torch.manual_seed(0)
    model, x = Attention(), _x().detach()
    x[0, 1, 3], x[1, 2, 5] = float("nan"), float("inf")
    x.requires_grad_()
    plain, _ = _grads(model, x)
    kept, _ = _grads(model, x, Deriving(None))
    rounded, stats = _grads(model, x, Deriving(CodecSpec("quant", {"bits": 8})))
    assert len(_linear_of(stats)) == 4
    for a, b, c in zip(plain, kept, rounded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)
        assert torch.equal(a.isnan(), c.isnan()) and torch.equal(a.isinf(), c.isinf())


def test_second_backward_and_freed_memory():
    torch.manual_seed(0)
    assert_second_backward_and_freed_memory(
        Attention(), _x(), Deriving(CodecSpec("quant", {"bits": 8}))
    )


def test_acgc_remakes_query_key_value_and_keeps_its_promise():
    """acgc on an attention block: q, k and v are remade from the shared input, whose
    holder alone gets a width; the measured gradient error stays within e."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), Attention())
    sites, policy, error = acgc_after_calibration(model, torch.randn(8, 16, 16), e=0.1)
    derived = [k for k, r in sites.items() if r.codec == "recomputed" and "linear" in r.settings]
    assert len(derived) >= 3  # q, kᵀ, v (and the GELU's input, the first Linear's product)
    assert not set(derived) & set(policy.site_bits)
    assert all(sites[k].gain > 0 for k in derived)
    assert policy.metrics()["grad_error"] <= 0.1
    assert error <= 0.1


def test_no_chain_of_products_runs_again():
    """Linear-GELU-Linear-GELU...: each product would be remade from the GELU before it,
    back to the input; a product is remade only from a stored tensor or one remade from
    stored ones, so every other pre-activation is stored."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32),
        nn.GELU(), nn.Linear(32, 4),
    )  # fmt: skip
    x = _x(shape=(8, 16))
    plain, _ = _grads(model, x)
    got, stats = _grads(model, x, Deriving(None))
    for a, b in zip(plain, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    linear = {k for k, v in _linear_of(stats).items() if k != ":0"}  # (":0": the loss's)
    assert linear == {"1:0", "5:0"}
    assert stats.sites["3:0"].codec != "recomputed"


class FusedAttention(nn.Module):
    """One projection for q, k and v (GPT-2's ``c_attn``, a char-LM's ``qkv``), split in
    three by ``unbind``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x * 1.0).view(4, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return self.out((p @ v).transpose(1, 2).reshape(4, 8, 16))


class _Products(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the products ``addmm`` makes (a Linear's forward; its backward uses mm)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.addmm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("low_peak", [False, True])
def test_one_product_remade_for_the_three_parts_of_a_fused_projection(low_peak, monkeypatch):
    """q, k and v are three views of one product: remade once for the three, also with
    ``low_peak`` (the input decoded again each time, to the same values). (The
    probabilities stored: remade from q and k, under ``low_peak`` they would decode them,
    and make the product, once more: test_derive_softmax.)"""
    monkeypatch.setattr(recompute, "softmax_of_product", lambda base: False)
    torch.manual_seed(0)
    model, x = FusedAttention(), _x(shape=(4, 8, 16))
    plain, _ = _grads(model, x)
    model.zero_grad()
    x.grad = None
    policy = Deriving(CodecSpec("quant", {"bits": 8}))
    with compress_activations(model=model, policy=policy, low_peak=low_peak) as stats:
        loss = model(x).square().mean()
    assert sum(r.settings.startswith("linear of") for r in stats.sites.values()) == 3
    with _Products() as products:
        loss.backward()
    assert products.count == 1
    got = [p.grad for p in model.parameters()] + [x.grad]
    flat_plain = torch.cat([g.reshape(-1) for g in plain])
    flat_got = torch.cat([g.reshape(-1) for g in got])
    assert (flat_got - flat_plain).norm() <= 0.05 * flat_plain.norm()


def test_the_shared_product_gives_plain_gradients_bit_for_bit():
    torch.manual_seed(0)
    stats = derived_matches_plain(FusedAttention(), _x(shape=(4, 8, 16)))
    assert sorted(_linear_of(stats).values()).count("qkv:0") == 3


def test_a_shared_product_is_let_go_after_the_last_taken_plan_s_unpack():
    """Only the plans the engine takes (``claim``) are waited for: a plan made and not
    taken (its product blocked) does not keep the product alive to the end of backward."""
    from lightning_acgc.engine.derive_linear import _Shared

    lin = nn.Linear(4, 6)
    x = torch.randn(3, 4, requires_grad=True) * 1.0
    y = lin(x)
    a, b = y.split(3, -1)
    taken = [linear_output(t, y, [Origin.of(x)]) for t in (a, b)]
    assert linear_output(a, y, [Origin.of(x)]) is not None  # made, not taken
    for plan in taken:
        plan.claim()
    memo = y.grad_fn.metadata[_Shared.KEY]
    x_hat = x.detach().clone()
    torch.testing.assert_close(taken[0].fn(x_hat), a.detach())
    assert memo.y is not None  # kept for b
    torch.testing.assert_close(taken[1].fn(x_hat), b.detach())
    assert memo.y is None
