"""Rotated queries and keys (``q·cos + rotate_half(q)·sin``, as Llama, Mistral and Qwen
rotate them), saved by the attention after them, remade at unpack from the projection's
input and the rotation's tables (lightning_acgc.engine.derive_rotary), for policies that
set ``derives_elementwise`` (acgc)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_acgc import compress_activations
from tests.test_derive import Deriving, derived_matches_plain


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def interleaved(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotation of neighbouring pairs: another form, not remade."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)


class RotaryAttention(nn.Module):
    """Four query heads, two key/value heads of 8, positions rotated; ``fused``: PyTorch's
    fused attention, else written out (the matmuls save the heads' copies)."""

    def __init__(
        self, fused: bool = True, turn=rotate_half, swapped: bool = False, cast: bool = True
    ) -> None:
        super().__init__()
        self.cast = cast  # the tables cast to q's dtype (else float32: q·cos promotes)
        self.q, self.k, self.v = nn.Linear(16, 32), nn.Linear(16, 16), nn.Linear(16, 16)
        self.o = nn.Linear(32, 16)
        self.fused, self.turn, self.swapped = fused, turn, swapped
        self.register_buffer("inv_freq", 10 ** -(torch.arange(4.0) / 4), persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.cast:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.swapped:
            return self.turn(x) * sin + cos * x
        return x * cos + self.turn(x) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # the tables made in forward (activations without history), as Hugging Face's
        angles = torch.arange(t, dtype=x.dtype)[:, None] * self.inv_freq
        angles = torch.cat((angles, angles), -1)[None, None]  # (1, 1, positions, 8)
        cos, sin = angles.cos(), angles.sin()
        q = self.rotate(self.q(x).view(b, t, 4, 8).transpose(1, 2), cos, sin)
        k = self.rotate(self.k(x).view(b, t, 2, 8).transpose(1, 2), cos, sin)
        v = self.v(x).view(b, t, 2, 8).transpose(1, 2)
        k, v = (u.repeat_interleave(2, dim=1) for u in (k, v))
        if self.fused:
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-1, -2)) / 8**0.5
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, 32))


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 32, 16, generator=g).requires_grad_()


def _rotated(stats) -> list:
    return [r for r in stats.sites.values() if r.settings.startswith("rotary of linear")]


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "eager"])
@pytest.mark.parametrize("swapped", [False, True], ids=["q-cos-first", "sin-first"])
def test_the_rotated_query_and_key_are_remade_with_plain_gradients(fused, swapped):
    torch.manual_seed(0)
    stats = derived_matches_plain(RotaryAttention(fused, swapped=swapped), _inputs())
    rotated = _rotated(stats)
    assert len(rotated) == 2 and all(r.packed_bytes == 0 for r in rotated)


@pytest.mark.parametrize("cast", [True, False], ids=["bf16-tables", "float32-tables"])
def test_under_bf16_autocast_too(cast):
    """The projections run in bf16 (the weights cast by autocast); with float32 tables
    (Llama's: made in the hidden states' dtype) the rotation runs in float32 and the
    attention takes a bf16 copy of it, remade as that cast."""
    torch.manual_seed(0)
    stats = derived_matches_plain(RotaryAttention(cast=cast), _inputs(), autocast=True)
    rotated = _rotated(stats)
    assert len(rotated) == 2 and all(r.dtype == "bfloat16" for r in rotated)


def test_another_rotation_is_not_remade():
    torch.manual_seed(0)
    stats = derived_matches_plain(RotaryAttention(turn=interleaved), _inputs())
    assert not _rotated(stats)


def test_tables_with_history_are_not_a_rotation():
    """A factor that takes a gradient (learned, or made of the input) is no table: the
    product saved it as an activation, remade by nothing here."""

    class Learned(RotaryAttention):
        def rotate(self, x, cos, sin):
            return super().rotate(x, cos * self.scale, sin)

    torch.manual_seed(0)
    model = Learned()
    model.scale = nn.Parameter(torch.ones(8))
    stats = derived_matches_plain(model, _inputs())
    assert not _rotated(stats)


def test_remade_from_what_the_holders_unpack():
    """Under a lossy codec the rotated query is the rotation of the projection remade
    from the input's decoded values with the decoded tables: finite, near the exact."""
    from lightning_acgc.codecs.spec import CodecSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), RotaryAttention())  # (the input: a holder)
    x = torch.randn(2, 128, 16).requires_grad_()
    exact = model(x)
    exact.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    policy = Deriving(CodecSpec("quant", {"bits": 8}))
    with compress_activations(model=model, policy=policy) as stats:
        out = model(x)
    out.square().mean().backward()
    rotated = _rotated(stats)
    assert len(rotated) == 2
    # the error reaches them from the projection's input and both tables
    for r in rotated:
        assert stats.sites[r.derived_from].module_type == "Linear"  # the projection's input
        tables = [stats.sites[site] for site, _ in r.also_from]
        assert len(tables) == 2 and all(t.shape == (1, 1, 128, 8) for t in tables)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.isfinite(p.grad).all()
        assert (p.grad - g).norm() <= 0.05 * g.norm()
