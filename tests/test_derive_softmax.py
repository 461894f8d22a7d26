"""An eager attention's probabilities remade at unpack from what the holders of the
scores' batched matmul operands unpack (lightning_acgc.engine.derive_softmax), for
policies that set ``derives_elementwise`` (acgc), once a measuring step has checked that
the remaking gives them back."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine import recompute
from lightning_acgc.engine.derive_softmax import softmax_of_product, softmax_output
from recipes.models.charlm import CausalSelfAttention
from tests.test_derive import Deriving, derived_matches_plain


class EagerAttention(nn.Module):
    """Attention written out with an additive term on the scores: a padding mask of the
    keys (``"padding"``: finfo.min where padded, as Hugging Face's eager BERT adds;
    ``"nothing"``: the same with no key padded; ``"left"``: causal, one sequence's first
    three keys padded), a
    finite bias that masks nothing (``"bias"``, ALiBi's kind), or every key of the last
    query row masked (``"row"``, filled with -1e9: that row comes out uniform)."""

    def __init__(self, added: str = "padding", scale: nn.Parameter | None = None) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)
        self.added, self.scale = added, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1)
        scores = scores * self.scale if self.scale is not None else scores / math.sqrt(8)
        if self.added in ("padding", "nothing"):
            keep = torch.ones(b, t, dtype=torch.bool)
            keep[0, t // 2 :] = self.added == "nothing"
            scores = scores + (~keep).float()[:, None, None, :] * torch.finfo(torch.float32).min
        elif self.added == "left":
            seen = torch.ones(t, t, dtype=torch.bool).tril().repeat(b, 1, 1)
            seen[0, :, :3] = False  # three pad tokens first: rows 0-2 see nothing
            scores = scores + (~seen).float()[:, None] * torch.finfo(torch.float32).min
        elif self.added == "bias":
            positions = torch.arange(t, dtype=torch.float32)
            scores = scores + -0.1 * (positions[:, None] - positions[None, :]).abs()
        elif self.added == "row":
            row = torch.zeros(t, t, dtype=torch.bool)
            row[-1] = True
            scores = scores.masked_fill(row, -1e9)
        p = scores.softmax(dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(b, t, 16))


def _inputs(seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, seq, 16, generator=g).requires_grad_()


def _remade(stats) -> list:
    return [r for r in stats.sites.values() if r.settings.startswith("softmax of")]


def test_a_causal_attention_stores_no_probabilities_and_gives_plain_gradients():
    """The char-LM recipe's attention: scale, masked_fill with its causal mask, softmax;
    ``p·v`` saves a view of the same probabilities (one holder)."""
    torch.manual_seed(0)
    model = CausalSelfAttention(hidden_size=16, num_heads=2, max_seq_len=12)
    stats = derived_matches_plain(model, _inputs())
    (remade,) = _remade(stats)
    assert remade.packed_bytes == 0 and remade.module_type == "CausalSelfAttention"
    assert remade.derived_from is not None and len(remade.also_from) == 1  # query and key
    views = [r for r in stats.sites.values() if r.derived_from == remade.key]
    assert any(r.settings.startswith("view of") for r in views)


def test_an_additive_padding_mask_is_kept_as_where_the_probabilities_are_zero():
    torch.manual_seed(0)
    stats = derived_matches_plain(EagerAttention("padding"), _inputs())
    (remade,) = _remade(stats)
    assert remade.packed_bytes == math.ceil(3 * 2 * 12 * 13 / 8)  # 1 bit a value and a row


def test_a_causal_mask_with_left_padding_masks_rows_whole():
    """A decoder's left padding (Hugging Face's causal mask plus the padding, finfo.min
    added): the first queries of a padded sequence see no key, their rows come out
    uniform, and are remade so."""
    torch.manual_seed(0)
    stats = derived_matches_plain(EagerAttention("left"), _inputs())
    (remade,) = _remade(stats)
    assert remade.packed_bytes == math.ceil(3 * 2 * 12 * 13 / 8)


def test_an_additive_mask_that_masks_nothing_costs_nothing():
    torch.manual_seed(0)
    stats = derived_matches_plain(EagerAttention("nothing"), _inputs())
    (remade,) = _remade(stats)
    assert remade.packed_bytes == 0


@pytest.mark.parametrize("added", ["bias", "row"])
def test_probabilities_not_given_back_by_their_remaking_are_stored(added):
    """A finite bias that masks nothing (the graph does not keep it) and a row masked
    whole by a finite fill (uniform, where -inf would give NaN): the check on the
    measuring step fails, so they are stored as usual, gradients still plain."""
    torch.manual_seed(0)
    stats = derived_matches_plain(EagerAttention(added), _inputs())
    assert not _remade(stats)
    assert any(
        r.module_type == "EagerAttention" and r.shape == (3, 2, 12, 12)
        for r in stats.sites.values()
    )


class Unmeasured(Deriving):
    measuring = False


def test_not_before_a_measuring_step_has_checked_the_site():
    torch.manual_seed(0)
    model = CausalSelfAttention(hidden_size=16, num_heads=2, max_seq_len=12)
    policy = Unmeasured(None)
    with compress_activations(model=model, policy=policy) as stats:
        model(_inputs()).sum().backward()
    assert not _remade(stats)


def test_a_learned_scale_or_stored_products_are_not_remade():
    torch.manual_seed(0)
    scale = nn.Parameter(torch.tensor(0.3))
    stats = derived_matches_plain(EagerAttention("padding", scale), _inputs())
    assert not _remade(stats)
    model = CausalSelfAttention(hidden_size=16, num_heads=2, max_seq_len=12)
    with compress_activations(model=model, policy=Deriving(None), remake_products=False) as s:
        model(_inputs()).sum().backward()
    assert not _remade(s)


def test_what_is_not_a_softmax_of_a_product():
    x = torch.randn(4, 6, requires_grad=True)
    assert not softmax_of_product(x.softmax(-1))  # no product
    y = torch.bmm(x.view(1, 4, 6), x.view(1, 6, 4))
    assert softmax_of_product(y.softmax(-1))
    assert not softmax_of_product(y.exp().softmax(-1))  # a step of another kind
    assert not softmax_of_product(torch.tanh(y))


def test_gains_in_closed_form():
    """Keys all zero: every probability is 1/t whatever the query (gain 0 on it). A key
    perturbation δk (variance σ² a value) moves row i's scores by q_i·δk, independent
    across the row, each of variance σ²‖q_i‖²; at the uniform point δp = (δs − mean δs)/t,
    so the gain is the mean of ‖q_i‖²·(1 − 1/t)/t²."""
    t, d = 16, 8
    q = torch.randn(64, t, d)
    kt = torch.zeros(64, d, t)
    p = torch.bmm(q.clone().requires_grad_(), kt.clone().requires_grad_()).softmax(-1)
    plan = softmax_output(p, p, lambda node, attr, exact: (attr != "_saved_other", 0))
    g_q, g_k = plan.gain(q, kt)
    assert g_q == pytest.approx(0.0, abs=1e-9)
    expected = float(q.square().sum(-1).mean()) * (1 - 1 / t) / t**2
    assert g_k == pytest.approx(expected, rel=0.1)
    assert plan.gain(None, kt) == (1.0, 1.0)


def test_the_key_projection_keeps_its_error_small_where_the_probabilities_were_rounded(
    monkeypatch,
):
    """The reason: rounded probabilities send an error into the key's gradient that the
    softmax's backward does not cancel; remade from the (rounded) query and key they are
    a softmax at perturbed scores. At one width for everything the key weight's
    gradient is several times nearer the exact one."""
    torch.manual_seed(0)
    model = CausalSelfAttention(hidden_size=16, num_heads=2, max_seq_len=64)
    x = torch.randn(4, 64, 16).requires_grad_()

    def k_error() -> float:
        model.zero_grad()
        model(x).square().mean().backward()
        exact = model.qkv.weight.grad[16:32].clone()
        model.zero_grad()
        with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 4}))):
            out = model(x)
        out.square().mean().backward()
        return float((model.qkv.weight.grad[16:32] - exact).norm() / exact.norm())

    remade = k_error()
    monkeypatch.setattr(recompute, "softmax_of_product", lambda base: False)
    rounded = k_error()
    assert remade * 3 < rounded


def test_low_peak_remakes_the_same_probabilities():
    """``low_peak`` decodes the query and key again at each unpack: the same values."""
    torch.manual_seed(0)
    model = CausalSelfAttention(hidden_size=16, num_heads=2, max_seq_len=12)
    x = _inputs()
    grads = []
    for low_peak in (False, True):
        model.zero_grad()
        policy = Deriving(CodecSpec("quant", {"bits": 4}))
        with compress_activations(model=model, policy=policy, low_peak=low_peak) as stats:
            out = model(x)
        out.square().mean().backward()
        assert _remade(stats)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_hugging_face_eager_bert_with_padding():
    """The BERT recipe's model (Hugging Face's eager attention: scale, the extended
    padding mask added, softmax, dropout off here): every layer's probabilities remade,
    gradients bit for bit as plain's."""
    from recipes.models.bert import BertClassifier

    torch.manual_seed(0)
    module = BertClassifier(
        num_classes=2, vocab_size=32, max_seq_len=16, hidden_size=16, num_layers=2,
        num_heads=2, intermediate_size=32, dropout=0.0,
    )  # fmt: skip
    ids = torch.randint(0, 32, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0
    batch = (ids, mask, torch.tensor([0, 1, 0]))

    def grads(policy=None) -> tuple[list[torch.Tensor], object]:
        module.zero_grad()
        with compress_activations(model=module, policy=policy or Deriving(None)) as stats:
            logits, y = module.logits_and_targets(batch, "train")
            loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
        return [p.grad.clone() for p in module.parameters() if p.grad is not None], stats

    module.zero_grad()
    logits, y = module.logits_and_targets(batch, "train")
    nn.functional.cross_entropy(logits, y).backward()
    plain = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    got, stats = grads()
    for a, b in zip(got, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    remade = _remade(stats)
    assert len(remade) == 2 and all(
        r.packed_bytes == math.ceil(3 * 2 * 16 * 17 / 8) for r in remade
    )


def test_under_bf16_autocast():
    """The char-LM's attention (bf16 scores, bf16 probabilities) and a float32 softmax of
    bf16 scores, as Hugging Face's eager Llama takes it (``softmax(s, dtype=float32)``)."""
    torch.manual_seed(0)
    model = CausalSelfAttention(hidden_size=16, num_heads=2, max_seq_len=12)
    stats = derived_matches_plain(model, _inputs(), autocast=True)
    assert len(_remade(stats)) == 1

    class Float32Softmax(CausalSelfAttention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-2, -1)) * (2 / c) ** 0.5
            p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return self.proj((p @ v).transpose(1, 2).reshape(b, t, c))

    torch.manual_seed(0)
    model = Float32Softmax(hidden_size=16, num_heads=2, max_seq_len=12)
    stats = derived_matches_plain(model, _inputs(), autocast=True)
    (remade,) = _remade(stats)
    assert remade.dtype == "float32"


def test_the_probabilities_are_freed_before_backward_on_an_ordinary_step():
    """What the plan holds is shapes, the holders and the mask bits, never the
    probabilities themselves (else they would stay alive as plain autograd keeps them)."""
    import gc
    import weakref

    from lightning_acgc.engine import ActivationCompressor

    class FirstStepMeasures(Deriving):
        measuring = True

    torch.manual_seed(0)
    model = EagerAttention("padding")
    policy = FirstStepMeasures(CodecSpec("quant", {"bits": 8}))
    engine = ActivationCompressor(policy, model=model)
    engine.install()
    made: list[weakref.ref] = []
    softmax = torch.Tensor.softmax

    def recorded(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = softmax(self, *args, **kwargs)
        made.append(weakref.ref(out))
        return out

    try:
        for step in range(2):
            policy.measuring = step == 0  # (a measuring step holds its last saves)
            made.clear()
            engine.new_step(step)
            with mock.patch.object(torch.Tensor, "softmax", recorded), engine.scope() as stats:
                out = model(_inputs())
            gc.collect()
            assert _remade(stats)
            if step == 1:
                assert made and made[0]() is None
            out.sum().backward()
    finally:
        engine.remove()
