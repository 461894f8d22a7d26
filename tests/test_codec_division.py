"""The ``division`` codec and its torch reference (kernels/division/).

Error bound used throughout: the decoder adds the same ``upsample(low)`` the encoder
subtracted, so ``x_hat - x = r_hat - r`` for the residual ``r = x - upsample(low)``.
Stochastic rounding puts ``r_hat`` on one of the two quantization levels around ``r``,
so ``|r_hat - r| <= step_g`` with ``step_g = range_g / (2^b - 1)`` for the residual's
quant group ``g`` (``range_g / (2^b - 2)`` in the quant format's zero-kept groups, whose
minimum is exactly 0). The zero-mask and finite-range clamps only move ``x_hat`` towards
``x``. On top come float32 arithmetic and the final rounding to the input dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_acgc.codecs.division  # noqa: F401  (registration)
from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.division import DivisionCodec, DivisionConfig
from lightning_acgc.codecs.registry import available_codecs, build_codec
from lightning_acgc.kernels.division import (
    division_decode,
    division_decode_ref,
    division_encode,
    division_encode_ref,
    division_lowpass_ref,
    division_upsample_ref,
    pool_axes,
)
from lightning_acgc.kernels.quant import uniform_noise

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _codec(**options: object) -> DivisionCodec:
    return build_codec("division", options)


def _round_trip(
    codec: DivisionCodec, x: torch.Tensor, seed: int = 0
) -> tuple[Packed, torch.Tensor]:
    packed = codec.encode(x, seed=seed)
    assert packed is not None
    y = codec.decode(packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    return packed, y


def _tolerance(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Per-element bound on |x_hat - x| derived from the residual's group ranges."""
    m = packed.meta
    bits, gs = m["residual_bits"], m["group_size"]
    xf = x.float()
    up = division_upsample_ref(packed.payload["low"].float(), x.shape, m["block"])
    r = (xf - up).reshape(-1)
    n = r.numel()
    rg = torch.cat([r, r[-1:].expand(-n % gs)]).view(-1, gs)
    lo, hi = torch.aminmax(rg.double(), dim=1)
    levels = 2**bits - 1
    zero_kept = (lo == 0) & (hi > 0) & (bits > 1)
    step = (hi - lo) / torch.where(zero_kept, levels - 1, levels)
    step = step.float().repeat_interleave(gs)[:n].view(x.shape)
    eps = torch.finfo(x.dtype).eps
    return step * (1 + 1e-5) + 1e-6 * (xf.abs() + up.abs() + step) + eps * (xf.abs() + step) + 1e-7


def _assert_within_bound(x: torch.Tensor, y: torch.Tensor, packed: Packed) -> None:
    err = (y.float() - x.float()).abs()
    tol = _tolerance(x, packed)
    worst = (err - tol).max()
    assert bool((err <= tol).all()), f"error exceeds the bound by {worst.item()}"


# --- low-pass / upsample -------------------------------------------------------------


@pytest.mark.parametrize(
    ("ndim", "axes"), [(0, ()), (1, (0,)), (2, (1,)), (3, (1,)), (4, (2, 3)), (5, (2, 3, 4))]
)
def test_pool_axes(ndim: int, axes: tuple[int, ...]) -> None:
    assert pool_axes(ndim) == axes


@pytest.mark.parametrize(
    ("shape", "block"),
    [
        ((2, 3, 16, 16), 8),
        ((2, 3, 13, 13), 8),
        ((1, 2, 5, 9, 11), 4),
        ((2, 13, 6), 4),
        ((3, 13), 8),
        ((13,), 3),
        ((7,), 16),
        ((2, 3, 5, 5), 1),
    ],
)
def test_lowpass_upsample_exact_on_tile_constant(shape: tuple[int, ...], block: int) -> None:
    pooled = tuple(-(-s // block) if i in pool_axes(len(shape)) else s for i, s in enumerate(shape))
    low = torch.randint(-100, 100, pooled).float()
    x = division_upsample_ref(low, shape, block)
    assert x.shape == shape
    torch.testing.assert_close(division_lowpass_ref(x, block), low, atol=0, rtol=0)
    torch.testing.assert_close(
        division_upsample_ref(division_lowpass_ref(x, block), shape, block), x, atol=0, rtol=0
    )


def test_lowpass_partial_tile_averages_real_elements() -> None:
    x = torch.arange(1.0, 6.0)  # [1, 2, 3, 4, 5], block 4: tiles [1..4] and [5]
    torch.testing.assert_close(division_lowpass_ref(x, 4), torch.tensor([2.5, 5.0]))
    img = torch.ones(1, 1, 10, 10)
    img[..., 8:, :] = 3.0  # partial tiles of the last rows hold only 3s
    low = division_lowpass_ref(img, 8)
    torch.testing.assert_close(low[0, 0], torch.tensor([[1.0, 1.0], [3.0, 3.0]]))


def test_lowpass_explicit_axes_and_errors() -> None:
    x = torch.randn(4, 6, 10)
    torch.testing.assert_close(
        division_lowpass_ref(x, 2, axes=(-1,)), x.unflatten(2, (5, 2)).mean(3)
    )
    with pytest.raises(ValueError, match="block"):
        division_lowpass_ref(x, 0)
    with pytest.raises(ValueError, match="axes"):
        division_lowpass_ref(x, 2, axes=(3,))
    with pytest.raises(ValueError, match="low has shape"):
        division_upsample_ref(torch.zeros(4, 6, 3), (4, 6, 10), 2, axes=(2,))


# --- round trips ---------------------------------------------------------------------


SHAPES = [(2, 4, 16, 16), (2, 3, 13, 13), (3, 37, 24), (5, 77), (301,), (1, 2, 5, 9, 11)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_round_trip_within_residual_step(
    shape: tuple[int, ...], dtype: torch.dtype, bits: int
) -> None:
    x = (torch.randn(shape) * 3 + torch.linspace(-2, 5, shape[-1])).to(dtype)
    packed, y = _round_trip(_codec(residual_bits=bits, group_size=64), x, seed=7)
    _assert_within_bound(x, y, packed)


@pytest.mark.parametrize("low_dtype", ["bfloat16", "float16", "float32"])
def test_low_dtype_is_stored(low_dtype: str) -> None:
    x = torch.randn(2, 3, 16, 16)
    packed, y = _round_trip(_codec(low_dtype=low_dtype), x)
    assert packed.payload["low"].dtype == getattr(torch, low_dtype)
    assert packed.payload["low"].shape == (2, 3, 2, 2)
    _assert_within_bound(x, y, packed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_dim(dtype: torch.dtype) -> None:
    x = torch.tensor(3.3, dtype=dtype)
    packed, y = _round_trip(_codec(), x)
    assert y.shape == ()
    _assert_within_bound(x, y, packed)


@pytest.mark.parametrize("shape", [(0,), (2, 0, 4, 4), (3, 0)])
def test_empty_is_kept_raw(shape: tuple[int, ...]) -> None:
    x = torch.empty(shape)
    packed, y = _round_trip(_codec(), x)
    assert packed.codec == "identity" and y.shape == shape


@pytest.mark.parametrize(
    "x",
    [
        torch.randint(0, 5, (4, 4)),
        torch.rand(4, 4) > 0.5,
        torch.randn(4, 4, dtype=torch.float64),
        torch.randn(4, 4, dtype=torch.complex64),
    ],
    ids=["int64", "bool", "float64", "complex64"],
)
def test_declines(x: torch.Tensor) -> None:
    assert _codec().encode(x, seed=0) is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 16, 16, 3).permute(0, 3, 1, 2),  # channels-last NCHW
        lambda: torch.randn(4, 3, 26, 26)[:, :, ::2, 1::2],  # strided 13x13
        lambda: torch.randn(40, 33).t(),
        lambda: torch.randn(3, 1, 12).expand(3, 5, 12),  # stride 0
        lambda: torch.randn(2, 20, 8, dtype=torch.bfloat16).transpose(1, 2),
    ],
    ids=["channels_last", "strided", "transposed", "expanded", "bf16_transposed"],
)
def test_non_contiguous(make) -> None:
    x = make()
    assert not x.is_contiguous()
    packed, y = _round_trip(_codec(group_size=32), x, seed=3)
    _assert_within_bound(x, y, packed)
    # the same values laid out contiguously give the same payload
    same = _codec(group_size=32).encode(x.contiguous(), seed=3)
    for key, value in packed.payload.items():
        torch.testing.assert_close(same.payload[key], value, atol=0, rtol=0)


@st.composite
def round_trip_cases(draw: st.DrawFn) -> tuple[torch.Tensor, dict[str, int], int]:
    """(x, codec options, seed): shapes of 0 to 5 dims, blocks, widths, groups, dtypes
    and scales (also run on a GPU by ``tests/test_gpu_codecs.py``)."""
    shape = tuple(draw(st.lists(st.integers(1, 17), min_size=0, max_size=5)))
    options = {
        "block": draw(st.integers(1, 9)),
        "residual_bits": draw(st.sampled_from([1, 2, 4, 8])),
        "group_size": draw(st.sampled_from([8, 24, 64, 256])),
    }
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    seed = draw(st.integers(0, 2**40))
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype), options, seed


@settings(max_examples=40, deadline=None)
@given(case=round_trip_cases())
def test_round_trip_property(case: tuple[torch.Tensor, dict[str, int], int]) -> None:
    x, options, seed = case
    packed, y = _round_trip(_codec(**options), x, seed=seed)
    _assert_within_bound(x, y, packed)


def test_unbiased_over_seeds() -> None:
    x = torch.randn(2, 4, 16, 16) + torch.linspace(0, 3, 16)
    codec = _codec(residual_bits=2, group_size=128)
    seeds = 300
    total = torch.zeros_like(x, dtype=torch.float64)
    for seed in range(seeds):
        packed, y = _round_trip(codec, x, seed=seed)
        total += y
    mean = (total / seeds).float()
    step = _tolerance(x, packed)  # about one residual step per element
    # stochastic rounding: variance <= step^2 / 4 per draw, so std of the mean <= step/(2 sqrt(S))
    assert bool(((mean - x).abs() <= 6 * step / (2 * math.sqrt(seeds)) + 1e-6).all())
    assert (mean - x).abs().mean() < 0.1 * (y - x).abs().mean()


# --- special values ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_survive(dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 13, 13)
    x[0, 0, 0, 0] = torch.nan
    x[0, 1, 5, 5] = -torch.inf
    x[1, 2, 8:, 8:] = torch.inf  # a whole partial tile
    x[1, 0, :8, :8] = torch.nan  # a whole tile
    x[1, 1, 3, :] = torch.nan
    x = x.to(dtype)
    packed, y = _round_trip(_codec(), x)
    assert torch.equal(y.isnan(), x.isnan())
    assert torch.equal(y.isposinf(), x.isposinf())
    assert torch.equal(y.isneginf(), x.isneginf())
    finite = x.isfinite()
    assert bool(y[finite].isfinite().all())
    step = packed.payload["scale"].abs().max()
    err = (y.float() - x.float())[finite].abs()
    assert err.max() <= step * 1.001 + torch.finfo(dtype).eps * x.float()[finite].abs().max()


def test_all_nan_and_nonfinite_relu() -> None:
    x = torch.full((3, 9), torch.nan)
    _, y = _round_trip(_codec(), x)
    assert bool(y.isnan().all())
    x = torch.randn(2, 2, 9, 9).relu()
    x[0, 0, 1, 1] = torch.nan
    x[1, 1, 8, 8] = torch.inf
    packed, y = _round_trip(_codec(), x)
    assert "zero_mask" in packed.payload
    assert torch.equal(y.isnan(), x.isnan()) and torch.equal(y.isinf(), x.isinf())
    assert torch.equal(y == 0, x == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 8])
def test_relu_zeros_exact_positives_positive(dtype: torch.dtype, bits: int) -> None:
    x = torch.randn(2, 8, 13, 13).relu()
    x[0, 0, 0, :5] = torch.tensor([1e-4, 2e-4, 0.0, 3e-4, 1e-4])  # tiny positives
    x[1, 1] *= 100.0  # a channel with a much wider range
    x = x.to(dtype)
    packed, y = _round_trip(_codec(residual_bits=bits, group_size=64), x, seed=5)
    assert "zero_mask" in packed.payload
    assert torch.equal(y == 0, x == 0)
    assert bool((y[x > 0] > 0).all())
    assert bool((y[x > 0] >= x[x > 0].min()).all())
    _assert_within_bound(x, y, packed)


@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(2, 4, 16, 16), lambda: torch.rand(2, 4, 16, 16) + 0.1, torch.zeros],
    ids=["signed", "positive", "all_zero"],
)
def test_zero_mask_only_when_it_applies(make) -> None:
    x = make() if make is not torch.zeros else torch.zeros(2, 4, 16, 16)
    packed, y = _round_trip(_codec(), x)
    assert "zero_mask" not in packed.payload
    assert ("min_pos" in packed.payload) == bool(x.min() > 0)  # a positive tensor's floor
    _assert_within_bound(x, y, packed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_positive_tensor_decodes_positive(dtype: torch.dtype, backend: str) -> None:
    """One-sided positive values (a softmax's denominators, (B, T, 1)): the 2-bit
    residual's step spans the whole group, and they decoded down to -3; a backward that
    divides by them gave NaN. Now floored at the tensor's minimum, bit for bit the same on
    the compiled CPU path as in torch."""
    g = torch.Generator().manual_seed(0)
    x = (1 + torch.rand(8, 64, 1, generator=g) * torch.rand(8, 1, 1, generator=g) * 20).to(dtype)
    codec = _codec()
    codec.backend = backend
    packed, y = _round_trip(codec, x, seed=3)
    assert "zero_mask" not in packed.payload and float(packed.payload["min_pos"]) == x.min()
    assert bool((y >= x.min()).all())
    _assert_within_bound(x, y, packed)
    reference = DivisionCodec(codec.config)
    reference.backend = "torch"
    ref = reference.encode(x, seed=3)
    for k, v in ref.payload.items():
        assert torch.equal(v, packed.payload[k]), k
    assert torch.equal(reference.decode(ref), y)


def test_low_overflow_falls_back_to_float32() -> None:
    x = torch.randn(2, 3, 16, 16) * 10 + 1e5  # averages beyond float16's 65504
    packed, y = _round_trip(_codec(low_dtype="float16"), x)
    assert packed.payload["low"].dtype == torch.float32
    _assert_within_bound(x, y, packed)
    fmax = torch.finfo(torch.float32).max
    x = torch.full((4, 16), fmax)  # rounds to inf in bfloat16
    packed, y = _round_trip(_codec(), x)
    assert packed.payload["low"].dtype == torch.float32
    assert bool(y.isfinite().all())
    torch.testing.assert_close(y, x)


def test_extreme_values_stay_finite() -> None:
    fmax = torch.finfo(torch.float32).max
    x = torch.tensor([fmax, -fmax, -fmax, 1.0, fmax, fmax, fmax, fmax])  # x - mean overflows
    _, y = _round_trip(_codec(block=4), x)
    assert bool(y.isfinite().all())
    torch.testing.assert_close(y[:3], x[:3], atol=0, rtol=0)  # kept exactly
    h = torch.tensor([65504.0, 65504.0, 60000.0, -65504.0, 0.5, 65504.0], dtype=torch.float16)
    for seed in range(20):
        _, y = _round_trip(_codec(block=2, residual_bits=1), h, seed=seed)
        assert bool(y.isfinite().all())


# --- size, determinism, dispatch -----------------------------------------------------


def test_compression_ratio_at_least_10x() -> None:
    x = torch.randn(32, 64, 32, 32)
    packed = _codec(residual_bits=2).encode(x, seed=0)
    ratio = x.numel() * x.element_size() / packed.nbytes
    assert ratio >= 10.0, ratio


def test_same_seed_same_bytes() -> None:
    x = torch.randn(3, 5, 13, 13).relu()
    x[0, 0, 0, 0] = torch.nan
    codec = _codec()
    a, b, c = (codec.encode(x, seed=s) for s in (11, 11, 12))
    assert a.payload.keys() == b.payload.keys() and a.meta == b.meta
    for key in a.payload:  # bytes, so that NaN == NaN
        assert torch.equal(a.payload[key].view(torch.uint8), b.payload[key].view(torch.uint8))
    assert not torch.equal(a.payload["codes"], c.payload["codes"])


def test_torch_rng_untouched() -> None:
    x = torch.randn(4, 300)
    state = torch.get_rng_state()
    _codec().encode(x, seed=1)
    assert torch.equal(state, torch.get_rng_state())


def test_dispatch_matches_reference_and_noise_override() -> None:
    x = torch.randn(2, 3, 13, 13)
    args = (8, 2, 64, torch.bfloat16, 9)
    ref = division_encode_ref(x, *args)
    for backend in ("torch", "auto"):
        out = division_encode(x, *args, backend=backend)
        for key in ref:
            assert torch.equal(out[key], ref[key]), key
    groups = -(-x.numel() // 64)
    noise = uniform_noise((groups, 64), 9, x.device)
    noisy = division_encode_ref(x, *args, noise=noise)
    again = division_encode_ref(x, *args, noise=noise.clone())
    other = division_encode_ref(x, *args, noise=uniform_noise((groups, 64), 10, x.device))
    assert torch.equal(noisy["codes"], again["codes"])  # the injected noise decides
    assert not torch.equal(noisy["codes"], other["codes"])
    y = division_decode(ref, x.shape, x.dtype, 8, 2, 64, backend="torch")
    assert torch.equal(y, division_decode_ref(ref, x.shape, x.dtype, 8, 2, 64))
    with pytest.raises(ValueError, match="backend"):
        division_encode(x, *args, backend="cuda")


# --- config --------------------------------------------------------------------------


def test_registered() -> None:
    assert "division" in available_codecs()
    codec = build_codec("division", DivisionConfig(block=4))
    assert isinstance(codec, DivisionCodec) and codec.config.block == 4
    assert codec.encode(torch.randn(8, 8), seed=0).codec == "division"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"block": 0}, "block"),
        ({"block": -8}, "block"),
        ({"block": 2.5}, "block"),
        ({"block": True}, "block"),
        ({"residual_bits": 3}, "residual_bits"),
        ({"residual_bits": 0}, "residual_bits"),
        ({"residual_bits": True}, "residual_bits"),
        ({"group_size": 100}, "group_size"),
        ({"group_size": 0}, "group_size"),
        ({"low_dtype": "int8"}, "low_dtype"),
        ({"low_dtype": torch.bfloat16}, "low_dtype"),
        ({"bits": 2}, "bits"),  # not an option of this codec
    ],
)
def test_bad_config_raises(options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build_codec("division", options)


def test_triton_backend_without_fused_kernel_uses_quant_kernels() -> None:
    """Until ``division_triton`` exists, backend='triton' runs the reference with the Triton
    quant (and mask) kernels, here under TRITON_INTERPRET=1 (set by conftest)."""
    import importlib.util

    from lightning_acgc.kernels.common.dispatch import triton_available

    pytest.importorskip("lightning_acgc.kernels.quant.triton")
    if not triton_available(torch.device("cpu")):
        pytest.skip("Triton cannot run on CPU here")
    x = torch.randn(2, 3, 13, 13)
    if importlib.util.find_spec("lightning_acgc.kernels.mask.triton") is not None:
        x = x.relu()  # also goes through the mask kernels
    codec = _codec(group_size=64)
    codec.backend = "triton"
    packed, y = _round_trip(codec, x, seed=2)
    assert torch.equal(y == 0, x == 0)
    _assert_within_bound(x, y, packed)
