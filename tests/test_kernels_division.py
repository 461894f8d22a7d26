"""Triton ``division`` path against the torch reference (CPU: under TRITON_INTERPRET=1).

The kernels sum each pooling tile in float32 in tile order, and so does the reference
(``torch.sum`` promises no order), so the pooled parts compare bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

import lightning_acgc.kernels.division as dk
from lightning_acgc.kernels.division.triton import (
    division_decode_triton,
    division_encode_triton,
    division_lowpass_triton,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(100,), (37, 61), (4, 29, 17), (2, 3, 13, 13), (2, 3, 16, 16), (2, 3, 5, 9, 11)]
_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_OF[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype, shape and bits."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


def assert_same_payload(p: dict[str, torch.Tensor], r: dict[str, torch.Tensor]) -> None:
    assert list(p) == list(r)
    for key in r:
        assert_same(p[key], r[key])


def _noise(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return torch.rand(-(-x.numel() // group_size), group_size)


def _check(x: torch.Tensor, block: int, bits: int, group_size: int, low: torch.dtype) -> None:
    """Bit-exact encode (injected noise) and decode, both cross directions."""
    noise = _noise(x, group_size)
    ref = dk.division_encode_ref(x, block, bits, group_size, low, 3, noise=noise)
    tri = division_encode_triton(x, block, bits, group_size, low, 3, noise=noise)
    assert_same_payload(tri, ref)
    expected = dk.division_decode_ref(ref, x.shape, x.dtype, block, bits, group_size)
    assert_same(division_decode_triton(ref, x.shape, x.dtype, block, bits, group_size), expected)
    torch.testing.assert_close(
        division_decode_triton(tri, x.shape, x.dtype, block, bits, group_size),
        expected,
        atol=0,
        rtol=0,
        equal_nan=True,
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [4, 8])
def test_lowpass_bit_exact(shape: tuple[int, ...], block: int) -> None:
    for dtype in DTYPES:
        x = torch.randn(shape).to(dtype)
        assert_same(division_lowpass_triton(x, block), dk.division_lowpass_ref(x, block))
    minus_zero = torch.full(shape, -0.0)  # torch's sums start from +0.0
    assert_same(
        division_lowpass_triton(minus_zero, block), dk.division_lowpass_ref(minus_zero, block)
    )


def test_lowpass_bit_exact_on_wide_ranges_and_partial_tiles() -> None:
    x = torch.randn(3, 4, 29, 45) * torch.exp(torch.randn(3, 4, 29, 45) * 3)
    assert_same(division_lowpass_triton(x, 8), dk.division_lowpass_ref(x, 8))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_decode_bit_exact(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape).to(dtype)
    _check(x, 4, 2, 64, torch.bfloat16)
    _check(x.relu(), 8, 4, 256, torch.float16)  # zero mask and min_pos


def test_irregular_large_shape() -> None:
    x = torch.randn(1823, 781).relu().to(torch.bfloat16)
    _check(x, 8, 2, 256, torch.bfloat16)


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize(
    "case", ["nan", "inf", "huge", "low_overflow", "fp16_low_overflow", "0d", "6d", "positive"]
)
def test_rare_cases_match_reference(case: str) -> None:
    x = torch.randn(2, 3, 10, 10)
    low = torch.bfloat16
    if case == "nan":
        x[0, 1, 2, 3] = float("nan")
    elif case == "inf":
        x[1, 2, 9, 9], x[0, 0, 0, 0] = float("inf"), -float("inf")
    elif case == "huge":
        x[0, 0, 0, 0] = 3e38
    elif case == "low_overflow":
        x[0, 0, :4, :4] = 1.6e38  # below float32 max / 2, but the float32 tile sum overflows
    elif case == "fp16_low_overflow":
        x = x * 1e5
        low = torch.float16
    elif case == "0d":
        x = torch.tensor(1.5)
    elif case == "positive":  # a floor at the minimum (min_pos without a zero mask)
        x = 1 + torch.rand(8, 64, 1) * torch.rand(8, 1, 1) * 20
    else:
        x = torch.randn(2, 1, 3, 4, 5, 6)
    _check(x, 4, 2, 64, low)


def test_philox_round_trip_within_one_step() -> None:
    x = torch.randn(4, 8, 24, 24)
    for bits in (2, 8):
        payload = division_encode_triton(x, 8, bits, 256, torch.float32, seed=5)
        y = division_decode_triton(payload, x.shape, x.dtype, 8, bits, 256)
        step = payload["scale"].abs().repeat_interleave(256)[: x.numel()].view(x.shape)
        assert bool(((y - x).abs() <= step + 1e-6 * x.abs()).all())
        again = division_encode_triton(x, 8, bits, 256, torch.float32, seed=5)
        assert_same_payload(again, payload)


def test_relu_keeps_zero_pattern() -> None:
    x = torch.randn(2, 4, 17, 19).relu().to(torch.float16)
    payload = division_encode_triton(x, 8, 1, 64, torch.bfloat16, seed=0)
    y = division_decode_triton(payload, x.shape, x.dtype, 8, 1, 64)
    assert torch.equal(y == 0, x == 0)
    assert bool((y[x > 0] > 0).all())


def test_dispatch_uses_fused_module() -> None:
    x = torch.randn(2, 3, 12, 12).relu()
    via = dk.division_encode(x, 4, 2, 64, torch.bfloat16, 9, backend="triton")
    assert_same_payload(via, division_encode_triton(x, 4, 2, 64, torch.bfloat16, 9))
    assert_same(
        dk.division_decode(via, x.shape, x.dtype, 4, 2, 64, backend="triton"),
        dk.division_decode(via, x.shape, x.dtype, 4, 2, 64, backend="torch"),
    )


def test_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match="block=0"):
        division_encode_triton(x, 0, 2, 64, torch.bfloat16, 0)
    with pytest.raises(TypeError, match="dtype"):
        division_encode_triton(x.double(), 4, 2, 64, torch.bfloat16, 0)
    with pytest.raises(TypeError, match="low_dtype"):
        division_encode_triton(x, 4, 2, 64, torch.int8, 0)
    with pytest.raises(ValueError, match="empty"):
        division_encode_triton(x[:0], 4, 2, 64, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="contiguous"):
        division_lowpass_triton(x.transpose(2, 3), 4)
    payload = division_encode_triton(x, 4, 2, 64, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="expected"):
        division_decode_triton(payload, (2, 3, 16, 4), x.dtype, 4, 2, 64)
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        division_encode_triton(x, 4, 2, 64, torch.bfloat16, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_bit_exact_against_cuda_reference(dtype: torch.dtype) -> None:
    x = torch.randn(8, 64, 56, 56, device="cuda").relu().to(dtype)
    noise = torch.rand(-(-x.numel() // 256), 256, device="cuda")
    ref = dk.division_encode_ref(x, 8, 2, 256, torch.bfloat16, 1, noise=noise)
    tri = division_encode_triton(x, 8, 2, 256, torch.bfloat16, 1, noise=noise)
    assert_same_payload(tri, ref)
    assert_same(
        division_decode_triton(ref, x.shape, dtype, 8, 2, 256),
        dk.division_decode_ref(ref, x.shape, dtype, 8, 2, 256),
    )
