"""A dropout's float mask packed at 1 bit, and its output remade from its input and its
mask (lightning_acgc.engine.derive_dropout)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.mask import MaskCodec, MaskConfig
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.derive_dropout import without_history
from lightning_acgc.policies.fixed import FixedPolicy
from tests.test_derive import Deriving, acgc_after_calibration


class Attention(nn.Module):
    """softmax -> dropout -> product with the values: the dropped probabilities are
    saved by the product, the undropped ones by the softmax, the mask by the dropout."""

    def __init__(self, fused: bool = False, p: float = 0.25) -> None:
        super().__init__()
        self.q, self.v, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.fused, self.p = fused, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, v = self.q(x), self.v(x)
        probs = torch.softmax(q @ q.transpose(1, 2) / 4, dim=-1)
        if self.fused:  # CUDA's dropout: a bool mask and p saved
            dropped = torch.native_dropout(probs, self.p, True)[0]
        else:  # CPU's: a float mask saved
            dropped = F.dropout(probs, self.p, training=True)
        return self.out(dropped @ v)


def _inputs(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 32, 16, generator=g)


def _grads(model: nn.Module, x: torch.Tensor, policy=None, **options):
    model.zero_grad()
    torch.manual_seed(7)  # the same dropout masks in every pass
    if policy is None:
        model(x).square().mean().backward()
        stats = None
    else:
        with compress_activations(model=model, policy=policy, **options) as stats:
            loss = model(x).square().mean()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()], stats


def _node(root, name: str):
    """The first autograd node of type ``name`` reached from ``root``."""
    todo, seen = [root], set()
    while todo:
        node = todo.pop(0)
        if type(node).__name__ == name:
            return node
        seen.add(node)
        todo += [n for n, _ in node.next_functions if n is not None and n not in seen]
    raise LookupError(name)


@pytest.mark.parametrize("fused", [False, True], ids=["float mask", "fused bool mask"])
def test_kept_input_gives_plain_gradients_and_the_output_is_stored_as_nothing(fused):
    torch.manual_seed(0)
    model, x = Attention(fused), _inputs()
    plain, _ = _grads(model, x)
    got, stats = _grads(model, x, Deriving(None), compress_loss=True)
    for a, b in zip(got, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    dropped = [r for r in stats.sites.values() if r.settings.startswith("dropout of")]
    assert len(dropped) == 1 and dropped[0].packed_bytes == 0 and dropped[0].codec == "recomputed"
    assert dropped[0].shape == (4, 32, 32)
    masks = [r for r in stats.sites.values() if r.codec == "mask"]
    assert len(masks) == 1 and masks[0].packed_bytes == 4 * 32 * 32 // 8 + (0 if fused else 8)


def test_derived_output_is_the_rounded_input_times_the_exact_mask():
    torch.manual_seed(0)
    model, x = Attention(), _inputs(1)
    with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 4}))):
        torch.manual_seed(7)
        out = model(x)
    bmm, mul = _node(out.grad_fn, "BmmBackward0"), _node(out.grad_fn, "MulBackward0")
    dropped_hat = bmm._saved_self.reshape(4, 32, 32)  # what the product's backward unpacks
    noise, softmax = mul._saved_other, mul.next_functions[0][0]
    probs_hat = softmax._saved_result
    assert noise.unique().tolist() == [0.0, torch.tensor(1 / 0.75).item()]  # exact
    torch.testing.assert_close(dropped_hat, probs_hat * noise, rtol=0, atol=0)
    torch.manual_seed(7)
    with torch.no_grad():
        q = model.q(x)
        exact = torch.softmax(q @ q.transpose(1, 2) / 4, dim=-1)
    assert not torch.equal(probs_hat, exact)  # the probabilities were rounded


def test_a_mask_held_lossily_is_not_used():
    """Without the mask codec (compress_masks off) the float mask goes to the policy's
    rounding codec: the dropped probabilities are then packed, not remade from it."""
    torch.manual_seed(0)
    model, x = Attention(), _inputs()
    _, stats = _grads(model, x, Deriving(CodecSpec("quant", {"bits": 8})), compress_masks=False)
    assert not any(r.settings.startswith("dropout of") for r in stats.sites.values())
    assert not any(r.codec == "mask" for r in stats.sites.values())


def test_a_product_by_a_constant_that_is_not_a_mask_is_remade_only_where_kept_exactly():
    """``x·c`` with a many-valued constant ``c``: remade where ``c`` is kept as it is
    (a keep-all policy), packed where the policy rounds ``c``."""
    c, w = torch.randn(64, 64), torch.randn(64, 8, requires_grad=True)

    def f(x):
        h = torch.tanh(x)  # tanh saves its output h
        return (h * c) @ w  # the mul saves c, the product h·c

    x = torch.randn(64, 64, requires_grad=True)
    plain = torch.autograd.grad(f(x).square().sum(), (x, w))
    with compress_activations(policy=Deriving(None), compress_loss=True) as stats:
        loss = f(x).square().sum()
    for a, b in zip(torch.autograd.grad(loss, (x, w)), plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(r.settings.startswith("dropout of") for r in stats.sites.values())
    with compress_activations(policy=Deriving(CodecSpec("quant", {"bits": 8}))) as stats:
        f(x)
    assert not any(r.settings.startswith("dropout of") for r in stats.sites.values())


def test_policies_without_derivation_pack_the_float_mask_at_one_bit():
    torch.manual_seed(0)
    model, x = Attention(), _inputs()
    _, stats = _grads(model, x, FixedPolicy(CodecSpec("quant", {"bits": 2})))
    masks = [r for r in stats.sites.values() if r.codec == "mask"]
    assert len(masks) == 1 and masks[0].settings == "1 bit"
    assert not any(r.codec == "recomputed" for r in stats.sites.values())


def test_the_identity_control_keeps_the_float_mask_as_it_is():
    torch.manual_seed(0)
    model, x = Attention(), _inputs()
    _, stats = _grads(model, x, FixedPolicy(CodecSpec("identity", {})))
    assert not any(r.codec == "mask" for r in stats.sites.values())


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (torch.tensor([0.0, 4 / 3, 0.0, 4 / 3]), True),
        (torch.full((5,), 2.5), True),
        (torch.tensor([0.0, 1.0, 2.0]), False),
        (torch.tensor([0.0, float("nan")]), False),
        (torch.tensor([float("-inf"), float("inf")]), True),
        (torch.tensor([0, 1, 1]), False),  # integers: the engine's integer codec
    ],
)
def test_the_mask_codec_takes_exactly_the_two_valued_float_tensors(values, expected):
    """The engine offers every float tensor without history to the mask codec, which
    decides: it declines (None) what it cannot hold exactly, and round-trips the rest."""
    packed = MaskCodec(MaskConfig()).encode(values, 0)
    assert (packed is not None) is expected
    if expected:
        assert torch.equal(MaskCodec(MaskConfig()).decode(packed), values)


def test_a_tensor_with_history_is_not_offered_to_the_mask_codec():
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    assert without_history(torch.tensor([0.0, 1.0]))
    assert not without_history(x) and not without_history(x * 1)
    assert not without_history(torch.tensor([0, 1]))


def test_a_many_valued_constant_falls_through_to_the_policys_codec():
    """A float tensor without history that is not a mask (an input normalised inside the
    model) is declined by the mask codec and packed by the policy's codec."""

    class Scales(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            c = torch.linspace(0.5, 1.5, x.numel()).view_as(x)  # no history, many values
            return (self.fc(x) * c).sum()

    torch.manual_seed(0)
    model, x = Scales(), torch.randn(32, 64)
    _, stats = _grads(model, x, FixedPolicy(CodecSpec("quant", {"bits": 8})))
    codecs = sorted(r.codec for r in stats.sites.values())
    assert "mask" not in codecs and codecs.count("quant") >= 2, codecs


def test_a_mask_codec_that_fails_hands_the_mask_to_the_policys_codec(monkeypatch):
    """Training goes on, and the warning says what happens to the tensor next."""

    def fail(self, x, seed):
        raise RuntimeError("broken kernel")

    monkeypatch.setattr(MaskCodec, "encode", fail)
    torch.manual_seed(0)
    model, x = Attention(), _inputs()
    with pytest.warns(UserWarning, match="mask failed at .*broken kernel.*policy's codec next"):
        grads, stats = _grads(model, x, FixedPolicy(CodecSpec("quant", {"bits": 8})))
    assert not any(r.codec == "mask" for r in stats.sites.values())
    assert all(torch.isfinite(g).all() for g in grads)


def test_acgc_remakes_the_dropped_probabilities_and_keeps_its_promise():
    """(The policy's own verified error: each step draws new masks, so the helper's
    error against one exact gradient says nothing here.)"""
    torch.manual_seed(0)
    model, x = Attention(), _inputs(2)
    torch.manual_seed(7)
    sites, policy, _ = acgc_after_calibration(model, x, e=0.1)
    dropped = [r for r in sites.values() if r.settings.startswith("dropout of")]
    assert len(dropped) == 1 and dropped[0].derived_from is not None
    assert 1.2 < dropped[0].gain < 1.45  # mean m² = 1/(1 − p) = 4/3
    # the probabilities are remade too (derive_softmax): from the query and its
    # transpose (a view of it), which the policy allocates
    probabilities = sites[dropped[0].derived_from]
    assert probabilities.settings.startswith("softmax of")
    roots = [probabilities.derived_from, *(k for k, _ in probabilities.also_from)]
    stored = {sites[k].derived_from or k for k in roots}
    assert stored and stored <= set(policy.site_bits), (stored, policy.site_bits)
    assert policy.metrics()["grad_error"] <= 0.1


class Embeddings(nn.Module):
    """BERT's embeddings: LayerNorm -> dropout -> a Linear, the LayerNorm's output saved
    by no op (the dropout saves its mask only); and a feed-forward's GELU -> dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(x * 2.0))
        return self.b(self.drop(F.gelu(self.a(h))))


def test_a_dropout_input_that_no_op_saved_is_remade_from_its_own_input():
    torch.manual_seed(0)
    model, x = Embeddings(), _inputs(3).requires_grad_()  # (an input without history: kept)
    plain, _ = _grads(model, x)
    got, stats = _grads(model, x, Deriving(None), compress_loss=True)
    for a, b in zip(got, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    a_in, b_in = stats.sites["a:0"], stats.sites["b:0"]
    assert a_in.codec == "recomputed" and a_in.settings.startswith("dropout of layer_norm of")
    assert b_in.codec == "recomputed" and b_in.settings.startswith("dropout of gelu of")
    assert a_in.derived_from == "norm:0" and b_in.derived_from == ":0"  # F.gelu's input


def test_torch_transformer_layer_with_dropout_gives_plain_gradients():
    """nn.TransformerEncoderLayer in training (dropout 0.2): every tensor kept, outputs
    remade, the gradients are plain's bit for bit, and its dropout outputs are remade."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.2, activation="gelu", batch_first=True)
    x = _inputs(4)
    plain, _ = _grads(layer, x)
    got, stats = _grads(layer, x, Deriving(None), compress_loss=True)
    for a, b in zip(got, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(r.settings.startswith("dropout of gelu") for r in stats.sites.values())
