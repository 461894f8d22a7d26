"""A fused attention's output (PyTorch's CPU flash kernel) remade at unpack from what the
holders of its query, key and value unpack (lightning_acgc.engine.derive_attention), for
policies that set ``derives_elementwise`` (acgc)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine import recompute
from lightning_acgc.engine.derive_attention import attention_output
from tests.test_derive import Deriving, derived_matches_plain
from tests.test_derive_rotary import RotaryAttention


class Attention(nn.Module):
    """q, k and v projections (two key/value heads for four query heads where ``gqa``),
    the fused attention with a mask or causal, and the output projection."""

    def __init__(self, gqa: bool = True, mask: str = "causal", dropout: float = 0.0) -> None:
        super().__init__()
        kv = 16 if gqa else 32
        self.q, self.k, self.v = nn.Linear(16, 32), nn.Linear(16, kv), nn.Linear(16, kv)
        self.o = nn.Linear(32, 16)
        self.mask, self.dropout = mask, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k, v = (p(x).view(b, t, -1, 8).transpose(1, 2) for p in (self.k, self.v))
        mask = None
        if self.mask == "bool":
            mask = torch.ones(t, t, dtype=torch.bool).tril()
        elif self.mask == "float":
            mask = torch.zeros(t, t).masked_fill(torch.ones(t, t).triu(1).bool(), -1e4)
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=self.mask == "causal", dropout_p=self.dropout,
            enable_gqa=k.shape[1] != 4,
        )  # fmt: skip
        return self.o(out.transpose(1, 2).reshape(b, t, 32))


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 32, 16, generator=g).requires_grad_()


def _attended(stats) -> list:
    return [r for r in stats.sites.values() if r.settings.startswith("attention of")]


@pytest.mark.parametrize("mask", ["causal", "bool", "float"])
@pytest.mark.parametrize("gqa", [True, False], ids=["gqa", "mha"])
def test_the_output_is_remade_with_plain_gradients(mask, gqa):
    torch.manual_seed(0)
    stats = derived_matches_plain(Attention(gqa, mask), _inputs())
    attended = _attended(stats)
    assert len(attended) == 1 and attended[0].packed_bytes == 0
    # the output projection's input: a view of the one holder
    (view,) = [r for r in stats.sites.values() if r.settings.startswith("view of")]
    assert view.module_type == "Linear" and view.derived_from == attended[0].key


def test_after_rotary_positions_and_under_bf16_autocast():
    """Llama's form: q and k rotated (remade themselves); also in bf16."""
    for autocast in (False, True):
        torch.manual_seed(0)
        stats = derived_matches_plain(RotaryAttention(), _inputs(), autocast=autocast)
        (attended,) = _attended(stats)
        roots = [attended.derived_from, *(site for site, _ in attended.also_from)]
        assert all(stats.sites[s].settings.startswith("rotary of") for s in roots[:2])


def test_not_with_dropout_nor_where_products_are_stored():
    torch.manual_seed(0)
    stats = derived_matches_plain(Attention(dropout=0.0), _inputs())
    assert _attended(stats)
    model = Attention(dropout=0.5)
    with compress_activations(model=model, policy=Deriving(None)) as stats:
        model(_inputs()).sum().backward()
    assert not _attended(stats)
    model = Attention()
    with compress_activations(model=model, policy=Deriving(None), remake_products=False) as stats:
        model(_inputs()).sum().backward()
    assert not _attended(stats)


def test_a_mask_that_would_not_unpack_exactly_is_not_a_source():
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    mask = torch.zeros(8, 8)
    out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    exact = {"_saved_query": 0, "_saved_key": 1, "_saved_value": 2, "_saved_attn_mask": 3}

    def find(node, attr, want_exact):
        lossy = attr == "_saved_attn_mask" and want_exact
        return True, None if lossy else exact[attr]

    assert attention_output(out, out, find) is None

    def find_exact(node, attr, want_exact):
        return True, exact[attr]

    plan = attention_output(out, out, find_exact)
    assert plan is not None and plan.sources == (0, 1, 2, 3) and plan.roots == (0, 1, 2)


def test_gains_in_closed_form():
    """Keys all zero: every query attends uniformly over the keys it may see, so the
    output does not depend on the query (gain 0) and is the mean of those values (gain
    mean over rows of 1/(keys seen), causal: the harmonic mean of 1..t over t; read
    from one draw of the perturbation, over 4 x 4 x 32 independent columns)."""
    t = 64
    q, v = torch.randn(4, 4, t, 32), torch.randn(4, 4, t, 32)
    k = torch.zeros(4, 4, t, 32)
    out = nn.functional.scaled_dot_product_attention(
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), is_causal=True
    )
    holders = {"_saved_query": 0, "_saved_key": 1, "_saved_value": 2}

    def find(node, attr, exact):
        return (attr in holders), holders.get(attr)

    plan = attention_output(out, out, find)
    g_q, g_k, g_v = plan.gain(q, k, v)
    expected_v = sum(1 / n for n in range(1, t + 1)) / t
    assert g_q == pytest.approx(0.0, abs=1e-6)
    assert g_v == pytest.approx(expected_v, rel=0.1)
    assert g_k > 0  # a key's change moves the weights
    assert plan.gain(None, k, v) == (1.0, 1.0, 1.0)  # not at hand: no reading


def test_remade_from_what_the_holders_unpack():
    """Under a lossy codec the output is the attention of the decoded (remade) q, k and
    v: its gradients near the exact ones, every value finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Attention())
    x = torch.randn(2, 64, 16).requires_grad_()
    model(x).square().mean().backward()
    exact = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 8}))) as s:
        out = model(x)
    out.square().mean().backward()
    (attended,) = _attended(s)
    assert attended.gain > 0 and len(attended.also_from) == 2
    for p, g in zip(model.parameters(), exact, strict=True):
        assert torch.isfinite(p.grad).all()
        assert (p.grad - g).norm() <= 0.05 * g.norm()


def test_the_query_projection_keeps_its_error_small_where_the_output_was_rounded(monkeypatch):
    """The reason: the kernel's backward reads the output through ``D = rowsum(dO·O)``; a
    rounded output sends an error into the query's gradient along the keys' mean (rows
    of dS no longer sum to zero). Remade from q, k and v that error is gone: the query
    projection's weight gradient is several times nearer the exact one at one width."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Attention())
    with torch.no_grad():
        model[1].k.bias.add_(3.0)  # keys with a common part, as trained ones have
    x = torch.randn(4, 64, 16).requires_grad_()

    def q_error() -> float:
        model.zero_grad()
        model(x).square().mean().backward()
        exact = model[1].q.weight.grad.clone()
        model.zero_grad()
        with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 4}))):
            out = model(x)
        out.square().mean().backward()
        return float((model[1].q.weight.grad - exact).norm() / exact.norm())

    remade = q_error()
    monkeypatch.setattr(recompute, "fused_attention", lambda base: False)
    rounded = q_error()
    assert remade * 3 < rounded
