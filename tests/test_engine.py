"""The engine: which tensors are packed, sites, de-duplication, byte meter, cleanup."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

from lightning_acgc import CodecSpec, EngineSettings, compress_activations
from lightning_acgc.engine import ActivationCompressor, MemoryBudgetError
from lightning_acgc.engine.meter import LOSS_HALF
from tests._models import ResidualCNN, TransformerBlock, loss_of


def _probe_hooks_inactive() -> bool:
    """True when no saved-tensor hooks of ours are active: a fresh graph saves raw tensors
    (with ``compress_loss``: the probe's op runs outside the model, where tensors are
    kept by default)."""
    x = torch.randn(2000, requires_grad=True) * 1.0  # not a leaf: never a "parameter"
    y = x.sin()
    return y.grad_fn._saved_self.data_ptr() == x.data_ptr()


def test_parameters_integers_tiny_kept_bool_masked() -> None:
    lin = nn.Linear(64, 64)
    x = torch.randn(128, 64)
    idx = torch.randint(0, 64, (4096,))
    with compress_activations(codec="quant", bits=4, model=lin) as stats:
        h = lin(x)
        g = h.view(-1)[idx]  # saves an int64 index tensor
        small = (h[:2, :2] * 3.0).sin()  # saves a tiny tensor
        gated = torch.where(h > 0, h, 0.0)  # saves a bool condition
        (g.sum() + small.sum() + gated.sum()).backward()
    codecs = {r.settings for r in stats.sites.values() if r.codec == "kept"}
    assert "tiny" in codecs
    assert any(r.codec == "intpack" for r in stats.sites.values())  # integers: lossless
    assert any(r.codec == "mask" for r in stats.sites.values())
    # The weight is resident: never counted.
    assert not any(r.shape == (64, 64) for r in stats.sites.values())
    assert lin.weight.grad is not None and x.grad is None


class _Tanh(nn.Module):
    """A linear layer whose forward also runs a functional op of the root module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))  # saved inside the root's forward: site ":0"


def test_the_losss_log_probabilities_in_float16_keep_the_gradient() -> None:
    """Cross-entropy's saved log-probabilities in float16: the output gradient p − y stays
    within p·(exp(2**-11·|log p|) − 1) per element, confident predictions included; a
    value beyond float16's range keeps the tensor as it is."""
    logits = torch.randn(512, 40) * 6
    logits[:64, 0] += 30  # p -> 1 for the target of these rows: δ = p - 1 is tiny
    y = torch.zeros(512, dtype=torch.long)
    y[64:] = torch.randint(0, 40, (448,))
    grads = []
    for ctx in (contextlib.nullcontext(), compress_activations(codec="quant", bits=2)):
        z = logits.clone().requires_grad_()
        with ctx:
            loss = nn.functional.cross_entropy(z, y, reduction="sum")
        loss.backward()
        grads.append(z.grad)
    plain, half = grads
    p = torch.softmax(logits, -1)
    rounding = 2.0**-11 * (-torch.log_softmax(logits, -1)).clamp(min=2.0**-14)  # of log p
    bound = p * torch.expm1(rounding) + 2.0**-22 * plain.abs() + 1e-12  # and float32 ulps
    assert ((half - plain).abs() <= bound).all()
    assert (half != plain).any()  # it was rounded
    with compress_activations(codec="quant", bits=2) as stats:  # log p of -1e5: kept
        z = torch.tensor([[0.0, -1e5]], requires_grad=True).expand(2048, 2)
        nn.functional.cross_entropy(z, torch.zeros(2048, dtype=torch.long))
    assert stats.sites[":0"].codec == "kept", stats.sites  # half declined it


@pytest.mark.parametrize("compress_loss", [False, True])
def test_the_losss_own_tensors_are_float16_unless_asked(compress_loss: bool) -> None:
    """What the loss saves outside every module's forward (cross-entropy's
    log-probabilities) is stored as float16 by default, whatever the policy; what the
    root module's own forward saves is compressed like the rest."""
    torch.manual_seed(0)
    model = _Tanh()
    x, y = torch.randn(256, 64), torch.randint(0, 64, (256,))
    with compress_activations(
        codec="quant", bits=2, model=model, compress_loss=compress_loss
    ) as stats:
        nn.functional.cross_entropy(model(x), y).backward()
    outside = [r for r in stats.sites.values() if not r.module_type and r.dtype == "float32"]
    assert outside, stats.sites
    first = [r for r in outside if r.shared_with is None and r.settings != "tiny"]
    assert first, outside
    if compress_loss:
        assert all(r.codec == "quant" for r in first), outside
    else:
        assert all(r.codec == "half" and r.settings == LOSS_HALF for r in first), outside
        assert all(r.ratio == 2.0 for r in first), outside
    assert stats.sites[":0"].module_type == "_Tanh" and stats.sites[":0"].codec == "quant"
    assert stats.sites["fc:0"].codec == "quant"


def test_cpu_dropout_mask_round_trips_exactly() -> None:
    """CPU dropout saves a float mask {0, 1/(1-p)}: quant keeps it exact at any bits."""
    h = torch.randn(128, 64, requires_grad=True)
    torch.manual_seed(1)
    nn.functional.dropout(h, 0.3).sum().backward()
    exact = h.grad.clone()
    h.grad = None
    torch.manual_seed(1)
    with compress_activations(codec="quant", bits=1, compress_loss=True):  # no module
        nn.functional.dropout(h, 0.3).sum().backward()
    assert torch.equal(h.grad, exact)


def test_same_tensor_saved_twice_is_packed_once() -> None:
    x = torch.randn(4096, requires_grad=True)
    # (no module: the ops stand in for a model's, so the loss rule is off)
    with compress_activations(codec="quant", bits=8, keep_packed=True, compress_loss=True) as stats:
        y = x * 2
        (y * y).sum().backward()  # mul saves y twice (self and other)
    assert stats.tensors_packed == 1
    assert stats.saved_bytes == 4096 * 4
    assert torch.allclose(x.grad, 8 * x.detach(), atol=0.5)


def test_tensor_saved_by_two_ops_is_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ReLU output saved by the ReLU and by the next Linear: one encode, one decode,
    and both backward ops get the same values."""
    from lightning_acgc.codecs.quant import QuantCodec

    decodes = []
    decode = QuantCodec.decode
    monkeypatch.setattr(QuantCodec, "decode", lambda self, p: decodes.append(1) or decode(self, p))
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(128, 64)
    with compress_activations(codec="quant", bits=8, model=model) as stats:
        model(x).square().sum().backward()
    # packed: the input, the ReLU output (shared with the second Linear); the output,
    # saved by the loss's square outside the model, goes to float16: two quant decodes
    assert stats.tensors_packed == 3
    assert len(decodes) == 2
    assert [r.settings for r in stats.sites.values() if not r.module] == [LOSS_HALF]
    shared = [r for r in stats.sites.values() if r.shared_with is not None]
    assert [r.module for r in shared] == ["2"]


def test_views_of_one_tensor_saved_by_several_linears_are_packed_once() -> None:
    """q, k, v projections of one 3-D hidden state each save a fresh 2-D view of it."""
    qkv = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])
    h = torch.randn(8, 32, 64, requires_grad=True) * 1.0
    with compress_activations(codec="quant", bits=8, model=qkv) as stats:
        sum(lin(h).sum() for lin in qkv).backward()
    assert stats.tensors_packed == 1
    assert stats.saved_bytes == h.numel() * 4
    shared = [r for r in stats.sites.values() if r.shared_with is not None]
    assert len(shared) == 2


def test_reused_memory_is_not_mistaken_for_a_saved_tensor() -> None:
    """A dead tensor's memory reused for a same-shaped tensor must not hit the dedup cache."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())])
    x = torch.randn(64, 256)
    exact = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    with compress_activations(codec="quant", bits=8, model=model):
        got = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    for a, b in zip(got, exact, strict=True):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999


def test_sites_are_named_by_module_and_stable_across_steps() -> None:
    model = ResidualCNN()
    x = torch.randn(4, 3, 16, 16)
    keys = []
    for step in range(2):
        with compress_activations(codec="quant", model=model, seed=step) as stats:
            loss_of(model, x).backward()
        keys.append(list(stats.sites))
    assert keys[0] == keys[1]
    assert "stem.0:0" in keys[0] and "blocks.1.3:0" in keys[0]


def test_without_model_sites_are_named_by_type() -> None:
    model = ResidualCNN()
    with compress_activations(codec="quant") as stats:
        loss_of(model, torch.randn(4, 3, 16, 16)).backward()
    assert any(k.startswith("Conv2d#") for k in stats.sites)


def test_hooks_are_removed_on_exit_and_on_exception() -> None:
    model = ResidualCNN()
    with compress_activations(codec="quant", model=model, compress_loss=True):
        assert not _probe_hooks_inactive()
    assert _probe_hooks_inactive()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with (
        pytest.raises(RuntimeError, match="boom"),
        compress_activations(codec="quant", model=model, compress_loss=True),
    ):
        raise RuntimeError("boom")
    assert _probe_hooks_inactive()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_compression_does_not_change_global_rng_or_dropout() -> None:
    model = TransformerBlock()
    tokens = torch.randint(0, 64, (4, 16))
    torch.manual_seed(5)
    loss_of(model, tokens).backward()
    plain_next = torch.rand(3)
    torch.manual_seed(5)
    with compress_activations(codec="quant", bits=2, model=model, min_numel=0):
        loss_of(model, tokens).backward()
    assert torch.equal(torch.rand(3), plain_next)


def test_same_seed_same_packed_bytes() -> None:
    model = ResidualCNN()
    x = torch.randn(4, 3, 16, 16)
    payloads = []
    for _ in range(2):
        with compress_activations(
            codec="quant", bits=2, model=model, seed=11, keep_packed=True
        ) as st:
            loss_of(model, x).backward()
            payloads.append([t.clone() for p in st.packed for t in p.payload.values()])
    assert len(payloads[0]) == len(payloads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*payloads, strict=True))


def test_live_bytes_fall_back_after_backward() -> None:
    model = ResidualCNN()
    x = torch.randn(8, 3, 16, 16)
    with compress_activations(codec="quant", bits=2, model=model) as stats:
        loss = loss_of(model, x)
        during = stats.live_bytes
        loss.backward()
        del loss
    assert during >= stats.packed_bytes - x.numel() * 4
    assert stats.peak_live_bytes >= during
    assert stats.live_bytes <= x.numel() * 4  # only the input, still referenced here


def test_memory_budget_raises_an_error_lightning_sees_as_oom() -> None:
    from lightning.pytorch.utilities.memory import is_oom_error

    model = ResidualCNN()
    with (
        pytest.raises(MemoryBudgetError) as err,
        compress_activations(codec="identity", model=model, memory_budget=100_000),
    ):
        loss_of(model, torch.randn(8, 3, 16, 16))
    assert is_oom_error(err.value)


def test_failing_codec_keeps_tensor_and_warns_unless_strict() -> None:
    class Broken:
        name = "broken"

        def codec_for(self, site, x):
            return self

        def describe(self, codec):
            return ""

        def encode(self, x, seed):
            raise RuntimeError("codec bug")

    x = torch.randn(4096, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with compress_activations(policy=Broken(), codec="quant", compress_loss=True) as stats:
            (x * 1.0).sin().sum().backward()
    assert torch.allclose(x.grad, x.detach().cos())
    assert stats.tensors_kept == 1 and any("codec bug" in str(w.message) for w in caught)
    strict = EngineSettings(strict=True, compress_loss=True)
    with (
        pytest.raises(RuntimeError, match="codec bug"),
        compress_activations(policy=Broken(), settings=strict),
    ):
        (x * 1.0).sin()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"codec": "nope"}, r"codec='nope' is unknown; allowed values: \["),
        ({"codec": "quant", "bits": 3}, r"bits=3"),
        ({"codec": "quant", "group_size": 0}, "group_size"),
        ({"codec": "bounded", "error_bound": 0}, "error_bound"),
        ({"codec": "bounded", "error_bound": -1e-3}, "error_bound"),
        ({"codec": "quant", "backend": "cuda"}, "backend"),
        ({"codec": "quant", "min_numel": -1}, "min_numel"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine = {k: kwargs[k] for k in ("min_numel",) if k in kwargs}
        EngineSettings(**engine)
        codec = {k: v for k, v in kwargs.items() if k not in ("codec", "backend", *engine)}
        CodecSpec(kwargs["codec"], codec, kwargs.get("backend", "auto"))
    ran = []
    with pytest.raises(ValueError, match=match), compress_activations(**kwargs):
        ran.append(1)
    assert not ran


def test_offloaded_exact_pass_gives_the_same_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``offload_exact`` the exact pass's saved tensors go through
    ``save_on_cpu`` (as after a batch raise on a GPU) and the gradient is unchanged."""
    from lightning_acgc.engine.cycle import exact_gradients
    from lightning_acgc.policies import build_policy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    x = torch.randn(32, 16)
    engine = ActivationCompressor(build_policy("fixed"), model=model)
    plain = exact_gradients(engine, model, lambda: model(x).square().mean())
    packed: list[int] = []
    real = torch.autograd.graph.save_on_cpu

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook

            def counting(t: torch.Tensor):  # type: ignore[no-untyped-def]
                packed.append(t.numel())
                return pack(t)

            self.pack_hook = counting

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Spy)
    engine.offload_exact = True
    offloaded = exact_gradients(engine, model, lambda: model(x).square().mean())
    assert packed  # the pass saved through save_on_cpu
    assert plain is not None and offloaded is not None
    for name, g in plain.items():
        assert torch.equal(offloaded[name], g), name
