"""The ``half`` codec: within half a float16 ulp of every value, specials kept, and a
tensor it cannot hold declined (kept as it is), on adversarial inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_acgc.codecs import build_codec
from lightning_acgc.codecs.half import HALF_MAX, half_error_bound


@st.composite
def float32_tensors(draw: st.DrawFn) -> torch.Tensor:
    """0-d, empty and odd shapes; Gaussian, constant, huge, tiny (float16 subnormals and
    float32 denormals) and mixed values with NaN/±inf; sometimes a transposed view."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 30), min_size=ndim, max_size=ndim)))
    kind = draw(st.sampled_from(["normal", "constant", "near_max", "tiny", "denormal", "mixed"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(shape, generator=g)
    if kind == "constant":
        x = torch.full(shape, draw(st.floats(-6e4, 6e4, width=32)))
    elif kind == "near_max":
        x = (x.clamp(-1, 1) * HALF_MAX).clamp(-HALF_MAX, HALF_MAX)
    elif kind == "tiny":
        x = x * 1e-6  # float16 subnormals
    elif kind == "denormal":
        x = x * 1e-40  # below float16's smallest subnormal: rounds to a signed zero
    if kind == "mixed" and x.numel():
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (3,), generator=g)
        flat[idx] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    if draw(st.booleans()) and x.dim() >= 2:
        x = x.transpose(0, -1)
    return x


@settings(max_examples=80, deadline=None)
@given(x=float32_tensors())
def test_half_within_half_an_ulp_and_keeps_specials(x: torch.Tensor) -> None:
    codec = build_codec("half")
    y = codec.decode(codec.encode(x, seed=0))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(torch.isnan(x), torch.isnan(y))
    inf = torch.isinf(x)
    assert torch.equal(x[inf], y[inf])
    finite = torch.isfinite(x)
    error = (x[finite].double() - y[finite].double()).abs()
    assert bool((error <= half_error_bound(x[finite]).double()).all())
    assert torch.equal(torch.signbit(x[finite]), torch.signbit(y[finite]))


def test_half_halves_float32() -> None:
    packed = build_codec("half").encode(torch.randn(64, 32), seed=0)
    assert packed.nbytes == 64 * 32 * 2


@pytest.mark.parametrize("big", [65520.0, HALF_MAX * 1.001, 1e30, -7e4])
@pytest.mark.parametrize("special", [None, float("nan"), float("inf")])
def test_half_declines_a_finite_value_beyond_float16(big: float, special: float | None) -> None:
    """65520 and above round to inf; a NaN or inf elsewhere must not hide them."""
    x = torch.randn(100)
    x[17] = big
    if special is not None:
        x[3] = special
    assert build_codec("half").encode(x, seed=0) is None


def test_half_keeps_the_largest_values_that_round_to_a_finite_float16() -> None:
    x = torch.tensor([65519.0, -65519.0, 1.0])
    codec = build_codec("half")
    assert codec.decode(codec.encode(x, seed=0)).tolist() == [HALF_MAX, -HALF_MAX, 1.0]


def test_half_at_float16s_largest_value_and_with_infinities() -> None:
    x = torch.tensor([HALF_MAX, -HALF_MAX, float("inf"), -float("inf"), 0.0, -0.0])
    codec = build_codec("half")
    y = codec.decode(codec.encode(x, seed=0))
    assert torch.equal(y, x) and torch.equal(torch.signbit(y), torch.signbit(x))


@pytest.mark.parametrize(
    "x",
    [
        torch.arange(10),
        torch.randn(10, dtype=torch.float16),
        torch.randn(10, dtype=torch.bfloat16),
        torch.randn(10, dtype=torch.float64),
        torch.randn(10, dtype=torch.complex64),
    ],
)
def test_half_declines_what_it_would_not_shrink_or_could_not_hold(x: torch.Tensor) -> None:
    assert build_codec("half").encode(x, seed=0) is None


def test_half_keeps_an_empty_tensor_raw() -> None:
    x = torch.empty(0, 5)
    codec = build_codec("half")
    packed = codec.encode(x, seed=0)
    assert packed.codec == "identity" and codec.decode(packed).shape == (0, 5)
