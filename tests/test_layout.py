"""Decoded tensors come back with the sizes, strides and dtype autograd saved, under
every codec: channels_last, transposed, sliced and expanded views (eager mode)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs import CodecSpec
from lightning_acgc.engine import ActivationCompressor, EngineSettings
from lightning_acgc.engine.layout import compact, restore
from lightning_acgc.policies.fixed import FixedPolicy

CODECS: dict[str, dict] = {
    "quant": {"codec": "quant", "bits": 8},
    "bounded": {"codec": "bounded", "error_bound": 1e-3},
    "division": {"codec": "division"},
    "nonzero": {"codec": "nonzero", "bits": 8},
    "identity": {"codec": "identity"},
}

# name -> a view of a fresh tensor, as autograd may save it
VIEWS: dict[str, Callable[[], torch.Tensor]] = {
    "channels_last": lambda: torch.randn(4, 16, 8, 8).to(memory_format=torch.channels_last),
    "transposed": lambda: torch.randn(96, 64).t(),
    "permuted_3d": lambda: torch.randn(8, 32, 24).permute(2, 0, 1),
    "expanded": lambda: torch.randn(64, 1).expand(64, 512),
    "expanded_permuted": lambda: torch.randn(1, 32, 48).expand(6, 32, 48).transpose(1, 2),
    "sliced": lambda: torch.randn(64, 96)[:, 16:80],
    "strided_slice": lambda: torch.randn(64, 128)[:, ::2],
    "size_one_odd_stride": lambda: torch.randn(64, 48)[:, 5:6].expand(64, 1).t().t(),
    "contiguous": lambda: torch.randn(64, 96),
}


def _engine(options: dict) -> ActivationCompressor:
    options = dict(options)
    spec = CodecSpec(options.pop("codec"), options)
    # _pack is called outside any module: compress_loss, or every float would be kept
    settings = EngineSettings(min_numel=0, strict=True, compress_loss=True)
    return ActivationCompressor(FixedPolicy(spec), settings=settings)


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_unpack_restores_size_stride_dtype(codec: str, view: str) -> None:
    t = VIEWS[view]()
    engine = _engine(CODECS[codec])
    engine.new_step(0)
    saved = engine._pack(t)
    out = engine._unpack(saved)
    assert out.shape == t.shape
    assert out.stride() == t.stride()
    assert out.dtype == t.dtype and out.device == t.device
    assert out.is_contiguous(memory_format=torch.channels_last) == t.is_contiguous(
        memory_format=torch.channels_last
    )
    if codec == "division":  # lossy on noise: the same values as the contiguous copy gets
        if 0 not in t.stride():
            twin = _engine(CODECS[codec])
            twin.new_step(0)
            torch.testing.assert_close(
                out, twin._unpack(twin._pack(t.contiguous())), atol=0, rtol=0
            )
        return
    tol = {"quant": 0.05, "nonzero": 0.05, "bounded": 2e-3, "identity": 0.0}[codec]
    torch.testing.assert_close(out, t, atol=tol, rtol=0)


def test_expanded_tensor_is_encoded_once() -> None:
    """An expanded view is packed as its distinct values, not its expanded size."""
    t = torch.randn(4096, 1).expand(4096, 64)
    engine = _engine({"codec": "quant", "bits": 8})
    engine.new_step(0)
    saved = engine._pack(t)
    assert saved.packed.shape == (4096, 1)
    assert engine._unpack(saved).stride() == (1, 0)


def test_bool_mask_view_keeps_strides() -> None:
    t = (torch.randn(32, 64, 8) > 0).transpose(0, 2)
    engine = _engine({"codec": "quant", "bits": 4})
    engine.new_step(0)
    saved = engine._pack(t)
    assert saved.codec.name == "mask"
    out = engine._unpack(saved)
    assert out.stride() == t.stride() and torch.equal(out, t)


def test_overlapping_view_keeps_values() -> None:
    """An as_strided view that reads elements twice: sizes and values come back."""
    base = torch.randn(4096)
    t = base.as_strided((1000, 64), (4, 1))
    part, layout = compact(t)
    out = restore(part.contiguous(), layout)
    assert out.shape == t.shape and torch.equal(out, t)


@pytest.mark.parametrize("codec", ["quant", "identity"])
def test_channels_last_cnn_backward(codec: str) -> None:
    """A channels_last CNN trains through the hooks; identity gives the exact gradient and
    the convolution's saved input keeps its memory format."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 3, padding=1),
    ).to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 16, 16).to(memory_format=torch.channels_last)
    net(x).square().mean().backward()
    exact = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    options = CODECS[codec]
    with compress_activations(model=net, **options) as stats:
        y = net(x)
        saved = y.grad_fn._saved_input  # the second conv's input, decoded
        assert saved.is_contiguous(memory_format=torch.channels_last)
        y.square().mean().backward()
    assert stats.tensors_packed > 0 or codec == "identity"  # identity keeps tensors raw
    got = torch.cat([p.grad.flatten() for p in net.parameters()])
    want = torch.cat([g.flatten() for g in exact])
    if codec == "identity":
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    else:
        assert (got - want).norm() < 0.1 * want.norm()
