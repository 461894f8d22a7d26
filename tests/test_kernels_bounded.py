"""Triton ``bounded`` kernels against the torch reference (CPU: under TRITON_INTERPRET=1).

The codec is deterministic, so payloads and decoded values must be identical bit for bit,
in both directions (packed by one path, decoded by the other).
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_acgc.kernels.bounded import (
    RAW_WIDTH,
    bounded_decode,
    bounded_decode_ref,
    bounded_encode,
    bounded_encode_ref,
)
from lightning_acgc.kernels.bounded.triton import bounded_decode_triton, bounded_encode_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_OF[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype, shape and bits."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


def assert_same_payload(p: dict[str, torch.Tensor], r: dict[str, torch.Tensor]) -> None:
    """Bit-identical payloads, except the sign of ``lo`` in a constant group of zeros of
    both signs: which of -0.0/+0.0 a min returns is up to the reduction (torch's included);
    such a group decodes to +0.0 either way."""
    assert list(p) == list(r)
    for key in r:
        if key == "lo":
            assert_same(p[key] + 0.0, r[key] + 0.0)
            assert_same(p[key][r[key] != 0], r[key][r[key] != 0])
        else:
            assert_same(p[key], r[key])


def _check(x: torch.Tensor, error_bound: float, group_size: int, relative: bool) -> dict:
    """Bit-exact payload and decode, cross-decoded both ways; returns the payload."""
    ref = bounded_encode_ref(x, error_bound, group_size, relative)
    tri = bounded_encode_triton(x, error_bound, group_size, relative)
    assert_same_payload(tri, ref)
    n = x.numel()
    expected = bounded_decode_ref(ref, group_size, n, x.dtype)
    assert_same(bounded_decode_triton(ref, group_size, n, x.dtype), expected)
    assert_same(bounded_decode_ref(tri, group_size, n, x.dtype), expected)
    return ref


def _mixture(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Groups of every kind: signed, post-ReLU, constant, all zero, zeros among both signs,
    large magnitudes, tiny ranges."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).view(-1)
    part = max(1, x.numel() // 8)
    x[:part] = x[:part].clamp(min=0)
    x[part : 2 * part] = 0.5
    x[2 * part : 3 * part] = 0.0
    x[3 * part : 4 * part : 3] = 0.0
    x[4 * part : 5 * part] *= 3e3
    x[5 * part : 6 * part] = 1.0 + x[5 * part : 6 * part] * 1e-4
    return x.view(shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("error_bound", "relative"), [(1e-2, True), (1e-4, True), (1e-3, False), (0.25, False)]
)
@pytest.mark.parametrize("group_size", [64, 256])
def test_bit_exact(dtype: torch.dtype, error_bound: float, relative: bool, group_size: int) -> None:
    # 67 * 93 = 6231: tails of 23 (group 64) and 87 (group 256) values.
    _check(_mixture((67, 93), dtype), error_bound, group_size, relative)


def test_irregular_large_shape() -> None:
    _check(_mixture((1823, 781), torch.bfloat16, seed=1), 1e-3, 256, True)


def test_every_width_and_raw() -> None:
    """Ranges from 1 to 2^16 steps per group: widths 1..16, and raw groups beyond."""
    eb = 1e-3
    spans = 2 * eb * 1.05 * 2.0 ** torch.arange(0, 18, dtype=torch.float64)  # ~2^(w-1) steps
    x = 1.0 + torch.linspace(0, 1, 64, dtype=torch.float64) * spans[:, None]
    payload = _check(x.float().reshape(-1), eb, 64, False)
    widths = set(payload["width"].tolist())
    assert set(range(1, 17)) <= widths and RAW_WIDTH in widths
    xh = x.to(torch.bfloat16).reshape(-1)  # 16-bit dtypes: at most 15 bits, and grid steps
    assert RAW_WIDTH in set(_check(xh, 1e-3, 64, False)["width"].tolist())


@pytest.mark.parametrize("numel", [1, 7, 63, 64, 65, 257])
def test_tails_and_tiny_tensors(numel: int) -> None:
    x = torch.randn(numel)
    for group_size in (24, 64, 256):  # 24: not a power of two
        _check(x, 1e-2, group_size, True)
        _check(x.clamp(min=0), 1e-3, group_size, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("relative", [False, True])
def test_nonfinite_values(dtype: torch.dtype, relative: bool) -> None:
    x = torch.randn(1000).to(dtype)
    x[3], x[500], x[501] = float("nan"), float("inf"), -float("inf")
    x[128:192] = float("nan")  # a group without any finite value
    x[-1] = float("nan")  # copied into the tail padding
    payload = _check(x, 1e-2, 64, relative)
    y = bounded_decode_triton(payload, 64, x.numel(), dtype)
    special = ~torch.isfinite(x)
    torch.testing.assert_close(y[special], x[special], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_magnitudes(dtype: torch.dtype) -> None:
    top = torch.finfo(dtype).max
    x = torch.randn(3000).clamp(-1, 1) * top  # near the dtype's max
    _check(x.to(dtype), 1e-3, 64, True)
    tiny = torch.randn(3000) * 1e-30  # float32 subnormal-ish bound and steps
    _check(tiny.to(dtype), 1e-33, 64, False)
    _check(torch.full((777,), 3.0, dtype=dtype), 1e-3, 64, True)  # constant: eb = 0


def test_error_bound_holds() -> None:
    x = _mixture((100, 100), torch.float32)
    for eb in (1e-1, 1e-3, 1e-5):
        payload = bounded_encode_triton(x, eb, 256, False)
        y = bounded_decode_triton(payload, 256, x.numel(), x.dtype).view_as(x)
        assert float((y - x).abs().max()) <= eb
        assert torch.equal(y == 0, x == 0)


def test_dispatch_through_triton() -> None:
    x = _mixture((40, 50), torch.bfloat16)
    payload = bounded_encode(x, 1e-2, 64, True, backend="triton")
    assert_same_payload(payload, bounded_encode_ref(x, 1e-2, 64, True))
    assert_same(
        bounded_decode(payload, 64, x.numel(), x.dtype, backend="triton"),
        bounded_decode(payload, 64, x.numel(), x.dtype, backend="torch"),
    )


def test_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(10, 20)
    with pytest.raises(ValueError, match="contiguous"):
        bounded_encode_triton(x.t(), 1e-2, 64)
    with pytest.raises(TypeError, match="dtype"):
        bounded_encode_triton(x.double(), 1e-2, 64)
    with pytest.raises(ValueError, match="error_bound"):
        bounded_encode_triton(x, 0.0, 64)
    with pytest.raises(ValueError, match="group_size"):
        bounded_encode_triton(x, 1e-2, 12)
    with pytest.raises(ValueError, match="empty"):
        bounded_encode_triton(x[:0], 1e-2, 64)
    payload = bounded_encode_ref(x, 1e-2, 64)
    with pytest.raises(ValueError, match="numel=1000"):
        bounded_decode_triton(payload, 64, 1000, torch.float32)
    with pytest.raises(TypeError, match="raw"):
        bounded_decode_triton(payload, 64, 200, torch.float16)
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        bounded_encode_triton(x, 1e-2, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_bit_exact_against_cuda_reference(dtype: torch.dtype) -> None:
    x = _mixture((1823, 781), dtype).cuda()
    for eb, relative in ((1e-3, True), (1e-2, False)):
        ref = bounded_encode_ref(x, eb, 256, relative)
        tri = bounded_encode_triton(x, eb, 256, relative)
        assert_same_payload(tri, ref)
        assert_same(
            bounded_decode_triton(ref, 256, x.numel(), dtype),
            bounded_decode_ref(ref, 256, x.numel(), dtype),
        )
