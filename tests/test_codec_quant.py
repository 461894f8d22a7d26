"""Properties of the quant, mask and identity codecs (pure-torch path)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_acgc.codecs import build_codec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = [1, 2, 4, 8]


@st.composite
def tensors(draw: st.DrawFn, allow_special: bool = True) -> torch.Tensor:
    """Random shapes (0-d, empty, odd tails), dtypes, ranges; optional NaN/inf/denormals."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 40), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["normal", "constant", "huge", "denormal", "relu", "mixed"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "constant":
        x = torch.full(shape, draw(st.floats(-1e4, 1e4)), dtype=torch.float64)
    elif kind == "huge":
        x = x * (1e30 if dtype == torch.float32 else 6e4 / 4)
    elif kind == "denormal":
        x = x * (1e-40 if dtype == torch.float32 else 1e-6)
    elif kind == "relu":
        x = x.clamp(min=0)
    x = x.to(dtype)
    if kind == "mixed" and allow_special and x.numel():
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (3,), generator=g)
        flat[idx] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    if draw(st.booleans()) and x.dim() >= 2:
        x = x.transpose(0, -1)  # non-contiguous view
    return x


def _roundtrip(codec_name: str, x: torch.Tensor, seed: int = 0, **options):
    codec = build_codec(codec_name, options)
    packed = codec.encode(x, seed)
    return packed, codec.decode(packed)


def _check_special(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """NaN stays NaN, inf stays the same inf; returns the mask of finite elements."""
    assert torch.equal(torch.isnan(x), torch.isnan(y))
    inf = torch.isinf(x)
    assert torch.equal(x[inf], y[inf])
    return torch.isfinite(x)


@settings(max_examples=60, deadline=None)
@given(x=tensors(), bits=st.sampled_from(BITS), group=st.sampled_from([8, 64, 256]))
def test_quant_within_one_step_and_keeps_specials(x: torch.Tensor, bits: int, group: int) -> None:
    packed, y = _roundtrip("quant", x, bits=bits, group_size=group)
    assert y.shape == x.shape and y.dtype == x.dtype
    finite = _check_special(x, y)
    if x.numel() == 0:
        return
    # Within one quantization step of the element's group (+ output dtype rounding).
    scale = packed.payload["scale"].abs().double()
    steps = scale.repeat_interleave(group)[: x.numel()].view(-1)
    xd, yd = x.reshape(-1).double(), y.reshape(-1).double()
    ulp = torch.finfo(x.dtype).eps * xd.abs() + torch.finfo(x.dtype).tiny
    err = (xd - yd).abs()
    f = finite.reshape(-1)
    assert bool((err[f] <= steps[f] * (1 + 1e-5) + ulp[f]).all())


@settings(max_examples=40, deadline=None)
@given(x=tensors(allow_special=False), bits=st.sampled_from([2, 4, 8]))
def test_quant_keeps_zeros_and_signs_of_nonnegative_data(x: torch.Tensor, bits: int) -> None:
    x = x.clamp(min=0)
    _, y = _roundtrip("quant", x, bits=bits)
    assert torch.equal(x == 0, y == 0)
    assert bool((y >= 0).all())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quant_is_unbiased_over_seeds(bits: int, dtype: torch.dtype) -> None:
    x = torch.cat([torch.randn(1000), torch.randn(1000).relu()]).to(dtype)
    mean = torch.stack([_roundtrip("quant", x, s, bits=bits)[1].double() for s in range(400)]).mean(
        0
    )
    step = (x.double().max() - x.double().min()) / (2**bits - 1)
    bias = (mean - x.double()).mean().abs().item()
    # Mean error -> 0: the average over elements and seeds is far below one step.
    assert bias < 0.01 * step.item() + 3 * torch.finfo(dtype).eps


def test_quant_same_seed_same_bytes_other_seed_other_bytes() -> None:
    x = torch.randn(50, 70)
    a, _ = _roundtrip("quant", x, seed=7, bits=2)
    b, _ = _roundtrip("quant", x, seed=7, bits=2)
    c, _ = _roundtrip("quant", x, seed=8, bits=2)
    assert all(torch.equal(a.payload[k], b.payload[k]) for k in a.payload)
    assert not torch.equal(a.payload["codes"], c.payload["codes"])


def test_quant_does_not_touch_global_rng() -> None:
    x = torch.randn(1000)
    torch.manual_seed(3)
    expected = torch.rand(5)
    torch.manual_seed(3)
    _roundtrip("quant", x, seed=1)
    assert torch.equal(torch.rand(5), expected)


@pytest.mark.parametrize("bits", BITS)
def test_quant_packed_size(bits: int) -> None:
    x = torch.randn(64 * 256)
    packed, _ = _roundtrip("quant", x, bits=bits)
    assert packed.nbytes == x.numel() * bits // 8 + 64 * 8  # codes + fp32 lo/scale per group


@settings(max_examples=40, deadline=None)
@given(x=tensors())
def test_identity_is_exact(x: torch.Tensor) -> None:
    _, y = _roundtrip("identity", x)
    assert y is x or torch.equal(y.nan_to_num(), x.nan_to_num())


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(0, 30), max_size=3), p=st.floats(0, 1), seed=st.integers(0, 99))
def test_mask_is_lossless_for_bool_and_two_valued(shape: list[int], p: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) < p
    packed, y = _roundtrip("mask", m)
    assert torch.equal(y, m) and y.dtype == torch.bool
    if m.numel():
        assert packed.nbytes == (m.numel() + 7) // 8
    dropout = m.float() * 1.25  # dropout-style two-valued tensor
    _, z = _roundtrip("mask", dropout)
    assert torch.equal(z, dropout)


def test_mask_declines_other_tensors() -> None:
    codec = build_codec("mask")
    assert codec.encode(torch.randn(100), 0) is None
    assert codec.encode(torch.tensor([0.0, 1.0, float("nan")]), 0) is None
    assert codec.encode(torch.arange(10), 0) is None


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"bits": 3}, r"bits=3 .*allowed values: \[1, 2, 4, 8\]"),
        ({"bits": 0}, "bits"),
        ({"group_size": 0}, "group_size"),
        ({"group_size": -8}, "group_size"),
        ({"group_size": 12}, "group_size"),
        ({"bitz": 2}, r"does not take \['bitz'\]"),
    ],
)
def test_quant_bad_options(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_codec("quant", options)


def test_codecs_decline_integer_and_complex() -> None:
    codec = build_codec("quant")
    assert codec.encode(torch.arange(2000), 0) is None
    assert codec.encode(torch.randn(2000, dtype=torch.complex64), 0) is None
