"""A saved view of a tensor saved just before it, in another shape (an attention's
probabilities, saved by their softmax and, as a 3-D view, by ``p·v``), remade as that
view of the first one's decoded values (lightning_acgc.engine.derive_view), for policies
that set ``derives_elementwise`` (acgc)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.derive_view import view_plan
from tests.test_derive import Deriving, derived_matches_plain


class Attention(nn.Module):
    """Two-head attention without dropout on its probabilities (4-D matmuls);
    ``upcast``: its softmax in float32, cast back to the queries' dtype (Llama's)."""

    def __init__(self, upcast: bool = False) -> None:
        super().__init__()
        self.qkv, self.upcast = nn.Linear(16, 48), upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(4, 32, 3, 2, 8).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / 8**0.5
        if self.upcast:
            p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            p = torch.softmax(scores, dim=-1)
        return (p @ v).transpose(1, 2).reshape(4, 32, 16)


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 32, 16, generator=g).requires_grad_()


def _softmax_and_product(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the softmax's backward unpacks, what ``p·v``'s backward unpacks as p)."""
    stack, found = [out.grad_fn], {}
    while stack:
        node = stack.pop()
        kind = type(node).__name__
        if kind == "SoftmaxBackward0":
            found["softmax"] = node._saved_result
        if kind == "BmmBackward0" and "bmm" not in found:
            found["bmm"] = node._saved_self  # the first bmm from the output: p·v
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found["softmax"], found["bmm"]


def test_the_probabilities_are_packed_once_and_give_plain_gradients():
    torch.manual_seed(0)
    model, x = Attention(), _inputs()
    stats = derived_matches_plain(model, x)
    views = {k: r for k, r in stats.sites.items() if r.settings.startswith("view of")}
    assert len(views) == 1
    (rec,) = views.values()
    assert rec.codec == "recomputed" and rec.packed_bytes == 0 and rec.gain == 1.0
    assert stats.sites[rec.derived_from].shape == (4, 2, 32, 32)


def test_both_reads_see_one_rounding():
    torch.manual_seed(0)
    model, x = Attention(), _inputs()
    with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 4}))):
        out = model(x)
    soft, product = _softmax_and_product(out)
    assert not torch.equal(soft, torch.softmax(soft, -1))  # (a decoded, rounded tensor)
    torch.testing.assert_close(product, soft.reshape(8, 32, 32), rtol=0, atol=0)


def test_only_a_view_of_the_same_values_is_remade():
    p = torch.softmax(torch.randn(2, 3, 4, 4, requires_grad=True), -1)
    t = p.reshape(6, 4, 4)
    assert view_plan(t, [p]) is not None
    assert view_plan(p, [p]) is None  # not a view
    assert view_plan(t, [p.detach().clone()]) is None  # another storage
    assert view_plan(p[:, :1].reshape(2, 4, 4), [p[:, 1:]]) is None  # elements it lacks
    q = p.transpose(-1, -2)  # laid out as p, indexed otherwise: dense in another order
    plan = view_plan(t, [q])
    assert plan is not None and torch.equal(plan.fn(q.detach().contiguous()), t.detach())
    assert view_plan(t, [p[:, :, :, :2]]) is None  # a slice: not dense


class FusedAttention(nn.Module):
    """Heads split by a view and a transpose (Hugging Face's layout), the fused attention
    (its output laid out (batch, seq, heads, dim)), and the output projection, which
    saves that output's (batch, seq, heads·dim) view: one storage saved twice."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(4, 32, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).contiguous().reshape(4, 32, 16))


def test_a_fused_attention_s_output_is_packed_once():
    torch.manual_seed(0)
    stats = derived_matches_plain(FusedAttention(), _inputs())
    views = [r for r in stats.sites.values() if r.settings.startswith("view of")]
    assert len(views) == 1 and views[0].packed_bytes == 0 and views[0].module_type == "Linear"
    first = stats.sites[views[0].derived_from]  # the attention's own (derive_attention)
    assert first.shape == (4, 2, 32, 8) and first.settings.startswith("attention of")


def test_not_a_view_of_values_changed_in_place_since_they_were_saved():
    """Views share one version counter: the engine's own key of the first save (at its
    version) tells that its holder holds older values."""
    x = torch.randn(6, 4, requires_grad=True)
    for change in (False, True):
        with compress_activations(policy=Deriving(None), compress_loss=True) as stats:
            u = torch.exp(x * 1.0)  # exp saves its result, u
            if change:
                u.mul_(2)
            v = u.view(3, 8)
            _ = v * x.view(3, 8)  # saves the view v
        remade = [r for r in stats.sites.values() if r.settings.startswith("view of")]
        assert len(remade) == (0 if change else 1)


def test_autocast_s_copy_of_the_probabilities_is_cast_again():
    """Under bf16 autocast the softmax saves its float32 output and ``p·v`` a bf16 copy
    of it: remade as that cast of what the softmax's holder unpacks."""
    torch.manual_seed(0)
    stats = derived_matches_plain(Attention(upcast=True), _inputs(), autocast=True)
    casts = [r for r in stats.sites.values() if r.settings.startswith("bfloat16 cast of")]
    assert len(casts) == 1 and casts[0].packed_bytes == 0
    assert stats.sites[casts[0].derived_from].dtype == "float32"
