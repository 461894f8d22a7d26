"""``low_peak``: a tensor remade at unpack does not keep its sources decoded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_acgc import ActivationCompression, compress_activations
from lightning_acgc.codecs.quant import QuantCodec, QuantConfig
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine import EngineSettings
from lightning_acgc.engine.saved import Saved
from tests.test_derive import Deriving
from tests.test_derive_batch_norm import Residual


def _holders(keep_sources: bool) -> tuple[Saved, Saved, torch.Tensor]:
    """A packed source and a tensor recomputed from it (its square)."""
    codec = QuantCodec(QuantConfig(bits=8))
    x = torch.randn(4096)
    source = Saved(codec.encode(x, 0), codec, "src:0", "quant")
    source.pending = 1  # its own unpack, still to come
    made = Saved(None, None, "made:0", "recomputed", sources=(source,), recompute=torch.square)
    made.keep_sources = keep_sources
    return source, made, x


@pytest.mark.parametrize("keep_sources", [True, False])
def test_a_source_is_kept_decoded_only_when_asked(keep_sources: bool) -> None:
    source, made, x = _holders(keep_sources)
    squared = made.unpack()
    assert (source.decoded is not None) is keep_sources
    assert source.pending == 1  # a peek uses up none of the source's unpacks
    values = source.unpack()  # decoded again where it was not kept: the same values
    torch.testing.assert_close(squared, values.square(), rtol=0, atol=0)
    assert source.decoded is None and (values - x).abs().max() < 0.05


def test_low_peak_gives_the_same_gradients_on_residual_blocks() -> None:
    """Bit-identical gradients with and without ``low_peak`` (BatchNorm inputs at 4
    bits, the ReLUs after them and the residual sums remade from them)."""
    torch.manual_seed(0)
    model, x = Residual(), torch.randn(8, 3, 12, 12)
    grads, sites = [], []
    for low_peak in (False, True):
        model.zero_grad()
        policy = Deriving(CodecSpec("quant", {"bits": 4}))
        with compress_activations(model=model, policy=policy, low_peak=low_peak) as stats:
            loss = model(x).square().mean()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        sites.append(stats.sites)
    assert any(r.codec == "recomputed" for r in sites[1].values())
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_the_setting_reaches_the_engine() -> None:
    assert not EngineSettings().low_peak and EngineSettings(low_peak=True).low_peak
    callback = ActivationCompression(low_peak=True)
    assert callback.settings.low_peak
    with compress_activations(model=nn.Linear(2, 2), low_peak=True):
        pass
