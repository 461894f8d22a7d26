"""Per-channel normalization in front of ``quant`` for BatchNorm inputs
(:mod:`lightning_acgc.codecs.channels`): the error bound per channel, specials, layouts,
and the BatchNorm gradient it exists for."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs import CodecSpec
from lightning_acgc.codecs.channels import ChannelNormalized, channel_ranges
from lightning_acgc.codecs.quant import QuantCodec, QuantConfig
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies.fixed import FixedPolicy
from lightning_acgc.policies.gact import GACTPolicy
from tests.test_codec_quant import _check_special, tensors

BN = SiteInfo("bn", "BatchNorm2d", 0)


def _codec(bits: int = 2, group: int = 256) -> ChannelNormalized:
    return ChannelNormalized(QuantCodec(QuantConfig(bits=bits, group_size=group)))


def _assert_within_channel_step(packed, x: torch.Tensor, y: torch.Tensor, group: int) -> None:
    """|x − x̂| ≤ (the group's step of the normalized values) · (the channel's half range)."""
    if "channel_mid" not in packed.payload:  # passed to quant as it is
        return
    finite = _check_special(x, y)
    c, n = x.shape[1], x.numel()
    plane = n // (x.shape[0] * c) if n else 1
    step = packed.payload["scale"].abs().double().repeat_interleave(group)[:n]
    chan = (torch.arange(n) // plane) % c
    half = packed.payload["channel_half_range"].double().flatten()[chan]
    xd, yd = x.reshape(-1).double(), y.reshape(-1).double()
    eps = torch.finfo(x.dtype).eps
    # + rounding of (x − m)/s and of ŷ·s + m in float32, and of the output dtype
    slack = 4 * torch.finfo(torch.float32).eps * (xd.abs() + half) + eps * yd.abs()
    err = (xd - yd).abs()
    f = finite.reshape(-1)
    bound = step * half * (1 + 1e-5) + slack + torch.finfo(x.dtype).tiny
    assert bool((err[f] <= bound[f]).all()), float((err[f] - bound[f]).max())


@settings(max_examples=80, deadline=None)
@given(x=tensors(), bits=st.sampled_from([1, 2, 4, 8]), group=st.sampled_from([8, 64, 256]))
def test_within_one_step_of_each_channel_and_keeps_specials(x, bits: int, group: int) -> None:
    codec = _codec(bits, group)
    packed = codec.encode(x, seed=3)
    y = codec.decode(packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    _check_special(x, y)
    if x.dim() >= 2 and x.numel():
        _assert_within_channel_step(packed, x, y, group)
    torch.testing.assert_close(codec.decode(packed), y, rtol=0, atol=0, equal_nan=True)


def test_small_channels_get_errors_of_their_own_scale() -> None:
    """16 channels of 4×4 values with scales 1e-3 … 1e3 share every group of 256: plain
    quant gives the small channels errors of many times their range, this does not."""
    torch.manual_seed(0)
    scales = torch.logspace(-3, 3, 16).view(1, 16, 1, 1)
    x = torch.randn(8, 16, 4, 4) * scales + 0.5 * scales
    rng = x.amax(dim=(0, 2, 3)) - x.amin(dim=(0, 2, 3))
    plain = QuantCodec(QuantConfig(bits=2))
    err_plain = (plain.decode(plain.encode(x, 0)) - x).abs().amax(dim=(0, 2, 3)) / rng
    ours = _codec(2)
    err_ours = (ours.decode(ours.encode(x, 0)) - x).abs().amax(dim=(0, 2, 3)) / rng
    assert float(err_plain[0]) > 100  # the smallest channel: hundreds of its range
    assert bool((err_ours <= 1 / 3 + 1e-6).all())  # one 2-bit step of [−1, 1] = 2/3 · s


def test_constant_channels_are_exact_and_decoding_twice_is_the_same() -> None:
    x = torch.randn(4, 3, 5, 5)
    x[:, 1] = 7.25
    codec = _codec(2)
    packed = codec.encode(x, 0)
    first = codec.decode(packed)
    assert bool((first[:, 1] == 7.25).all())
    assert torch.equal(codec.decode(packed), first)


def test_nonfinite_and_tiny_channels_are_passed_as_they_are() -> None:
    x = torch.randn(2, 3, 8)
    x[0, 0, 0] = float("nan")
    x[1, 2, 3] = float("inf")
    m, s = channel_ranges(x)
    assert m.shape == (1, 3, 1) and m.flatten()[[0, 2]].tolist() == [0.0, 0.0]
    assert s.flatten()[[0, 2]].tolist() == [1.0, 1.0]
    tiny = torch.full((2, 2, 3), 1e-38)
    tiny[0, 0, 0] = 3e-38
    _, s = channel_ranges(tiny)
    assert s.flatten()[0].item() == 1.0  # half range 1e-38: 1/s would overflow


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_layouts_round_trip(dtype: torch.dtype) -> None:
    x = torch.randn(6, 8, 5, 7).to(dtype).contiguous(memory_format=torch.channels_last)
    codec = _codec(4)
    packed = codec.encode(x, 1)
    y = codec.decode(packed)
    assert y.dtype == dtype and y.shape == x.shape
    half = packed.payload["channel_half_range"]
    err = (y.float() - x.float()).abs()
    rounding = torch.finfo(dtype).eps * x.float().abs()
    assert bool((err <= 2 / 15 * half * (1 + 1e-5) + rounding + 1e-6).all())


def test_fixed_and_gact_normalize_batch_norm_inputs_only() -> None:
    x = torch.randn(4, 8, 3, 3)
    fixed = FixedPolicy(CodecSpec("quant", {"bits": 2}))
    assert isinstance(fixed.codec_for(BN, x), ChannelNormalized)
    assert fixed.codec_for(SiteInfo("conv", "Conv2d", 0), x) is fixed.codec
    assert fixed.describe(fixed.codec_for(BN, x)).endswith("per-channel")
    bounded = FixedPolicy(CodecSpec("bounded", {"error_bound": 0.1}))
    assert bounded.codec_for(BN, x) is bounded.codec  # an absolute bound stays absolute
    gact = GACTPolicy(bits=2)
    assert isinstance(gact.codec_for(BN, x), ChannelNormalized)
    assert not isinstance(gact.codec_for(SiteInfo("fc", "Linear", 0), x), ChannelNormalized)


def test_batch_norm_input_gradient_with_unequal_channels() -> None:
    """The gradient a BatchNorm passes back through 2-bit quantization stays near the
    exact one when its 16 channels of 4×4 values differ in scale by 10⁶."""
    torch.manual_seed(0)
    scales = torch.logspace(-3, 3, 16).view(1, 16, 1, 1)
    x0 = torch.randn(32, 16, 4, 4) * scales
    bn = nn.BatchNorm2d(16)
    target = torch.randn(32, 16, 4, 4)

    def grad(ctx=None) -> torch.Tensor:
        x = x0.clone().requires_grad_(True)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = (bn(x * 1.0) * target).sum()  # x * 1: a leaf is never packed
        loss.backward()
        return x.grad * scales  # every channel's gradient on one footing

    exact = grad()
    ours = grad(compress_activations(codec="quant", bits=2, model=bn))
    control = FixedPolicy(CodecSpec("quant", {"bits": 2}))
    control.norm_input_codec = control.codec  # quant's groups across channels
    plain = grad(compress_activations(policy=control, model=bn))
    rel_ours = float((ours - exact).norm() / exact.norm())
    rel_plain = float((plain - exact).norm() / exact.norm())
    assert rel_ours < 0.2  # 0.05 measured
    assert rel_plain > 1e3  # 1.5e8 measured: small channels' errors divided by σ_c
