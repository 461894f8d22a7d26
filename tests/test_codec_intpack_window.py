"""intpack's window mode: max-pool indices packed against each output's window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_acgc.codecs import build_codec
from lightning_acgc.kernels.common.cpu_lib import cpu_library
from lightning_acgc.kernels.intpack import intpack_decode, window_encode
from lightning_acgc.kernels.intpack.cpu import window_encode_cpu
from lightning_acgc.kernels.intpack.window import window_encode_ref, window_fit

# (input shape, kernel, stride, padding, ceil mode): ResNet's stem, U-Net's 2x2, odd sizes
GEOMETRIES = [
    ((2, 8, 32, 32), 2, 2, 0, False),
    ((2, 4, 112, 112), 3, 2, 1, False),
    ((2, 3, 9, 9), 3, 2, 1, False),
    ((2, 3, 7, 7), 2, 2, 0, True),
    ((2, 3, 10, 10), 3, 1, 1, False),
    ((1, 5, 33, 17), 3, 3, 0, False),
    ((3, 2, 16, 20), 5, 2, 2, False),
]


def _indices(shape: tuple[int, ...], k: int, s: int, p: int, ceil: bool) -> torch.Tensor:
    torch.manual_seed(0)
    return F.max_pool2d(torch.randn(shape), k, s, p, ceil_mode=ceil, return_indices=True)[1]


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_window_mode_is_lossless_and_narrow(geometry: tuple) -> None:
    idx = _indices(*geometry)
    payload = window_encode(idx)
    assert payload is not None
    assert int(payload["width"]) <= 6  # rows and columns of a window of <= 5 x 5
    assert torch.equal(intpack_decode(payload, 256, idx.numel(), idx.dtype), idx.view(-1))
    ref = window_encode_ref(idx, *window_fit(idx))
    assert torch.equal(
        intpack_decode(ref, 256, idx.numel(), idx.dtype, backend="torch"), idx.view(-1)
    )


@pytest.mark.skipif(cpu_library() is None, reason="no compiled CPU kernels")
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_window_cpu_path_writes_the_references_bytes(geometry: tuple) -> None:
    idx = _indices(*geometry)
    fit = window_fit(idx)
    ref, fast = window_encode_ref(idx, *fit), window_encode_cpu(idx, *fit)
    assert ref.keys() == fast.keys()
    assert all(torch.equal(ref[k], fast[k]) for k in ref)


@pytest.mark.skipif(cpu_library() is None, reason="no compiled CPU kernels")
def test_window_cpu_path_repacks_when_the_last_ranges_do_not_match() -> None:
    """The C path packs with the last same-shaped tensor's code parameters and checks them
    in the same pass: narrower, wider and equal ranges all give the reference's bytes."""
    wide = _indices((2, 8, 32, 32), 2, 2, 0, False)
    i = torch.arange(16)[:, None]
    corners = (2 * 32 * i + 2 * torch.arange(16)).expand_as(wide).contiguous()  # offsets 0
    for x in (wide, corners, wide, wide):
        fit = window_fit(x)
        ref, fast = window_encode_ref(x, *fit), window_encode_cpu(x, *fit)
        assert all(torch.equal(ref[k], fast[k]) for k in ref)


def test_pooling_indices_pack_into_a_few_bits() -> None:
    """2x2 pooling of 64x64 planes: 2 bits a value (64 bits raw; plain intpack ~10)."""
    idx = _indices((8, 16, 64, 64), 2, 2, 0, False)
    codec = build_codec("intpack", {})
    packed = codec.encode(idx, seed=0)
    assert torch.equal(codec.decode(packed), idx)
    assert idx.numel() * 8 / packed.nbytes > 25


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_values_outside_the_window_fall_back_to_plain_intpack(backend: str) -> None:
    """A fit found on the first rows is only a guess: one value far from its window (or
    int64 extremes) and the tensor takes plain intpack, still exact."""
    idx = _indices((2, 4, 32, 32), 2, 2, 0, False)
    assert window_encode(idx, backend=backend) is not None
    for value in (10**6, torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max):
        bad = idx.clone()
        bad[1, 3, 15, 15] = value
        assert window_encode(bad, backend=backend) is None
        codec = build_codec("intpack", {})
        codec.backend = backend
        packed = codec.encode(bad, seed=0)
        if value == 10**6:  # 20-bit residuals in one group: still packed
            assert packed is not None
        if packed is not None:  # None: 64-bit residuals would not shrink, kept raw
            assert torch.equal(codec.decode(packed), bad)


def test_other_integer_tensors_keep_plain_intpack() -> None:
    """Constant, random and non-contiguous tensors: no window (a constant takes 0 bits
    plain), and every round trip exact."""
    codec = build_codec("intpack", {})
    idx = _indices((2, 4, 32, 32), 2, 2, 0, False)
    for x in (
        torch.zeros(3, 4, 5, dtype=torch.int32),
        torch.randint(-(2**62), 2**62, (3, 5, 7)),
        idx.transpose(-1, -2),
        idx.to(torch.int32),
    ):
        if x.is_contiguous() and x.dtype == torch.int64 and x.abs().max() > 2**40:
            assert window_encode(x) is None
        packed = codec.encode(x, seed=0)
        if packed is not None:
            assert torch.equal(codec.decode(packed), x)
    assert window_encode(torch.zeros(3, 4, 5, dtype=torch.int32)) is None
