"""Autocast's 16-bit copies of activations remade from what remakes the activation
(lightning_acgc.engine.derive_cast): a LayerNorm's, a GELU's or a dropout's float32
output cast for a bf16 Linear is stored as nothing, as the output itself is in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.derive import derive_plan, derived_output, unsaved_like
from lightning_acgc.engine.derive_cast import Unsaved, cast_output
from lightning_acgc.engine.derive_graph import Origin
from tests.test_derive import Deriving

BF16 = torch.bfloat16


class Block(nn.Module):
    """Embedding, LayerNorm, dropout, then query and key Linears (each casts its input
    under autocast), a GELU feed-forward: BERT's first block in small."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.norm, self.drop = nn.LayerNorm(32), nn.Dropout(p)
        self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 32)
        self.up, self.act, self.down = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(self.emb(ids)))
        a = self.q(h) * self.k(h)
        return self.down(self.act(self.up(a.float())))


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (8, 24), generator=torch.Generator().manual_seed(0))


def _grads(model: nn.Module, policy=None):
    """Gradients of one bf16-autocast step, with ``policy`` (None: plain); its stats."""
    model.zero_grad()
    stats = None
    torch.manual_seed(1)  # the dropout's mask alike
    with torch.autocast("cpu", dtype=BF16):
        if policy is None:
            loss = model(_ids()).float().square().mean()
        else:
            keep = getattr(policy, "keep_all", False)
            with compress_activations(model=model, policy=policy, compress_loss=keep) as stats:
                loss = model(_ids()).float().square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], stats


def test_casts_of_activations_are_remade_and_the_gradient_is_plain_s() -> None:
    torch.manual_seed(0)
    model = Block()
    plain, _ = _grads(model)
    derived, stats = _grads(model, Deriving(None))  # every input kept, outputs remade
    for a, b in zip(derived, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-4)  # (bf16: LayerNorm by formula)
    for key in ("q:0", "k:0"):  # each Linear's own copy of the dropout's output
        rec = stats.sites[key]
        assert rec.codec == "recomputed" and rec.packed_bytes == 0
        assert rec.settings == "bfloat16 cast of dropout of layer_norm of norm:0"
    assert stats.sites["down:0"].settings.startswith("gelu of")  # (no cast: up is bf16)


def test_a_cast_remade_from_a_rounded_input_is_its_activation_cast() -> None:
    h = (torch.randn(6, 16) * 3).requires_grad_() * 1.0
    g = F.gelu(h)
    saved = g.to(BF16)
    assert derived_output(saved)
    plan = derive_plan(saved, [Origin.of(h)])
    assert plan is not None and plan.name == "bfloat16 cast of gelu" and plan.sources == (0,)
    rounded = (h.detach() * 8).round() / 8
    torch.testing.assert_close(plan.fn(rounded), F.gelu(rounded).to(BF16), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
def test_a_cast_of_an_unsaved_gelu_output_is_bit_identical(dtype: torch.dtype) -> None:
    x = (torch.randn(5, 7) * 4).requires_grad_()
    h = x * 1.0
    saved = F.gelu(h).to(dtype)
    plan = cast_output(saved, saved, [Origin.of(h)], unsaved_like)
    assert plan is not None
    assert torch.equal(plan.fn(h.detach()), saved.detach()) and plan.fn(h.detach()).dtype == dtype


def test_the_source_dtype_is_never_guessed() -> None:
    # the GELU's input is float16 here, its output cast to bf16: only float16 matches
    h = torch.randn(4, 8, dtype=torch.float16).requires_grad_() * 1.0
    saved = F.gelu(h).to(BF16)
    plan = cast_output(saved, saved, [Origin.of(h)], unsaved_like)
    assert plan is not None and torch.equal(plan.fn(h.detach()), saved.detach())
    # with the input missing (another tensor of its shape and dtype), nothing
    other = torch.randn(4, 8, dtype=torch.float16).requires_grad_() * 1.0
    assert cast_output(saved, saved, [Origin.of(other)], unsaved_like) is None


def test_casts_that_are_not_of_an_activation_stay_packed() -> None:
    w = nn.Parameter(torch.randn(4, 4))
    assert not derived_output(w.to(BF16))  # a parameter's copy: engine/param_casts.py
    x = torch.randn(4, 4, requires_grad=True)
    assert not derived_output((x @ x).to(BF16))  # a product: not remade through a cast
    assert not derived_output((x * x).to(BF16))  # a product of two activations


def test_the_stand_in_describes_a_contiguous_tensor() -> None:
    like = Unsaved(None, torch.Size([2, 3, 4]), torch.float32, torch.device("cpu"))
    assert like.stride() == torch.empty(2, 3, 4).stride() and like.is_contiguous()
    assert like.dim() == 3 and like.storage_offset() == 0 and like._base is None


def test_casts_are_compressed_through_their_source_under_acgc() -> None:
    torch.manual_seed(0)
    model = Block(p=0.0)
    _, stats = _grads(model, Deriving(CodecSpec("quant", {"bits": 4})))
    assert stats.sites["q:0"].codec == "recomputed"
    assert stats.sites["q:0"].derived_from == "norm:0"  # its error: the LayerNorm input's
