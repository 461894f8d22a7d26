"""Properties of the quant, mask and identity codecs (pure-torch path)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_acgc.codecs import build_codec
from lightning_acgc.codecs.quant import QuantCodec, QuantWidthConfig
from lightning_acgc.kernels.quant.reference import hash_key, hash_uniform
from tests._noise_spec import element_noise

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = [1, 2, 3, 4, 5, 6, 7, 8]  # users set 1, 2, 4, 8; acgc any width


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
    if codec_name == "quant":  # every width, as acgc builds them
        codec = QuantCodec(QuantWidthConfig(**options))
    else:
        codec = build_codec(codec_name, options)
    packed = codec.encode(x, seed)
    return packed, codec.decode(packed)


def _check_special(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """NaN stays NaN, inf stays the same inf; returns the mask of finite elements."""
    assert torch.equal(torch.isnan(x), torch.isnan(y))
    inf = torch.isinf(x)
    assert torch.equal(x[inf], y[inf])
    return torch.isfinite(x)


def checked_round_trip(codec, x: torch.Tensor, seed: int):
    """Encode and decode ``x`` with ``codec``: shape, dtype, NaN and inf come back.
    ``(packed, decoded, finite mask)``, or ``None`` where no value has a step to check
    (an empty tensor, one kept as it is)."""
    packed = codec.encode(x, seed=seed)
    y = codec.decode(packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    finite = _check_special(x, y)
    if x.numel() == 0 or packed.codec == "identity":
        return None
    return packed, y, finite


def output_rounding(xd: torch.Tensor, yd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Slack for storing the decoded value in ``dtype``: at most half an ulp of the output
    ``yd`` (not of the input: a value a whole step above a small input rounds on the
    output's scale; bfloat16 x = 0.177 decoded to 2.434 stored as 2.4375), plus the
    smallest normal for values near zero."""
    return torch.finfo(dtype).eps * torch.maximum(xd.abs(), yd.abs()) + torch.finfo(dtype).tiny


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
    ulp = output_rounding(xd, yd, x.dtype)
    err = (xd - yd).abs()
    f = finite.reshape(-1)
    assert bool((err[f] <= steps[f] * (1 + 1e-5) + ulp[f]).all())


@settings(max_examples=40, deadline=None)
@given(x=tensors(allow_special=False), bits=st.sampled_from([2, 3, 4, 5, 8]))
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
    "x",
    [
        torch.full((37,), 2.5),  # one value
        torch.tensor(1.25),  # 0-d
        torch.tensor([float("-inf"), float("inf"), float("inf")] * 7),
        torch.tensor([0.0, -0.0, 1e-45, 0.0] * 5),  # a denormal beside zeros
        (torch.rand(9, 40) < 0.5).float().t(),  # non-contiguous
        (torch.rand(300) < 0.5).to(torch.bfloat16) * 3,
    ],
    ids=["constant", "0-d", "infinities", "denormal", "transposed", "bf16"],
)
def test_mask_two_valued_round_trips_exactly(x: torch.Tensor) -> None:
    packed, y = _roundtrip("mask", x)
    assert packed.codec == "mask" and y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, x)


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


def _assert_within_one_step(packed, x: torch.Tensor, y: torch.Tensor, group: int) -> None:
    assert y.shape == x.shape and y.dtype == x.dtype
    finite = _check_special(x, y)
    if x.numel() == 0 or packed.codec == "identity":
        assert torch.equal(x[finite], y[finite])
        return
    scale = packed.payload["scale"].abs().double()
    steps = scale.repeat_interleave(group)[: x.numel()].view(-1)
    xd, yd = x.reshape(-1).double(), y.reshape(-1).double()
    ulp = output_rounding(xd, yd, x.dtype)
    f = finite.reshape(-1)
    assert bool(((xd - yd).abs()[f] <= steps[f] * (1 + 1e-5) + ulp[f]).all())


@settings(max_examples=60, deadline=None)
@given(x=tensors(), bits=st.sampled_from(BITS), group=st.sampled_from([8, 64, 256, 2048]))
def test_quant_bf16_meta_within_one_step(x: torch.Tensor, bits: int, group: int) -> None:
    packed, y = _roundtrip("quant", x, bits=bits, group_size=group, meta="bf16")
    _assert_within_one_step(packed, x, y, group)


_F32_MAX = torch.finfo(torch.float32).max
_ADVERSARIAL = {
    "constant": torch.full((300,), 1.2345678),
    "near_fp32_max": torch.tensor([-_F32_MAX, _F32_MAX, 0.0, 1.0] * 64),
    "near_bf16_max": torch.tensor([3.38e38, -3.38e38, 1e38, 0.0] * 64),
    "positive_near_max": torch.tensor([3.3e38, 3.0e38, 0.0, 3.39e38] * 64),
    "specials": torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, 0.0, 2.0] * 40),
    "denormal": torch.tensor([1e-45, 0.0, 7e-45, 1e-39, 2e-40] * 60),
    "relu_denormal": torch.tensor([0.0, 1e-45, 0.0, 3.0] * 64),
    "empty": torch.empty(0, 5),
    "zero_dim": torch.tensor(-2.5),
    "non_contiguous": torch.randn(40, 33).relu().t(),
    "tiny_range": torch.tensor([1.0, 1.0 + 2**-23, 1.0 + 2**-22] * 100),
    # zero-kept groups whose step is 0: the sign of a zero scale marks them
    "one_value_among_zeros": torch.tensor([0.0, 0.0, 2.5, 0.0] * 64),
}


@pytest.mark.parametrize("meta", ["fp32", "bf16"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", list(_ADVERSARIAL))
def test_quant_meta_adversarial(name: str, bits: int, meta: str) -> None:
    x = _ADVERSARIAL[name]
    packed, y = _roundtrip("quant", x, bits=bits, group_size=64, meta=meta)
    _assert_within_one_step(packed, x, y, 64)
    if bits > 1 and not bool((x < 0).any()):
        assert torch.equal(x == 0, y == 0)  # zeros exact, no positive decodes to 0


def test_quant_bf16_meta_costs_32_bits_per_group_and_is_kept_exact_enough() -> None:
    x = torch.randn(64 * 256)
    packed, _ = _roundtrip("quant", x, bits=2, meta="bf16")
    assert packed.payload["lo"].dtype == torch.bfloat16
    assert packed.nbytes == x.numel() * 2 // 8 + 64 * 4
    # A group whose smallest positive value is below bf16's smallest subnormal keeps fp32.
    packed, _ = _roundtrip("quant", torch.tensor([0.0, 1e-45, 2.0, 3.0] * 64), meta="bf16")
    assert packed.payload["lo"].dtype == torch.float32


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_quant_bf16_meta_is_unbiased_over_seeds(bits: int) -> None:
    x = torch.cat([torch.randn(1000) * 3 + 1, torch.randn(1000).relu()])
    ys = [_roundtrip("quant", x, s, bits=bits, meta="bf16")[1].double() for s in range(400)]
    mean = torch.stack(ys).mean(0)
    step = (x.double().max() - x.double().min()) / (2**bits - 1)
    assert (mean - x.double()).mean().abs().item() < 0.01 * step.item()


def test_widths_other_than_1_2_4_8_are_for_policies_not_users() -> None:
    with pytest.raises(ValueError, match=r"bits=3 is not allowed; allowed values: \[1, 2, 4, 8\]"):
        build_codec("quant", {"bits": 3})
    with pytest.raises(ValueError, match=r"bits=9 is not allowed; allowed values: \[1, 2, 3, 4"):
        QuantWidthConfig(bits=9)
    assert build_codec("quant", QuantWidthConfig(bits=5)).config.bits == 5


def test_quant_meta_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match=r"meta='fp16' is not allowed; allowed values"):
        build_codec("quant", {"meta": "fp16"})


def test_hash_uniform_gives_each_element_half_of_its_pairs_hash() -> None:
    seed = 12345
    u = hash_uniform(11, seed)  # an odd count: the last pair's high half is cut off
    assert u.tolist() == [element_noise(i, hash_key(seed)) for i in range(11)]
    # every value is a multiple of 2**-16 in [0, 1), and the two halves of a pair differ
    big = hash_uniform(1 << 16, seed)
    assert bool(((big >= 0) & (big < 1)).all())
    assert torch.equal(big * 2**16, (big * 2**16).floor())
    assert (big[0::2] != big[1::2]).float().mean().item() > 0.99
    assert abs(big.double().mean().item() - 0.5) < 0.01
