"""Triton ``mask`` kernels against the torch reference (CPU: under TRITON_INTERPRET=1):
lossless, so bit-exact both ways."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_acgc.codecs import build_codec
from lightning_acgc.kernels.mask import mask_pack, mask_pack_ref, mask_unpack, mask_unpack_ref
from lightning_acgc.kernels.mask.triton import mask_pack_triton, mask_unpack_triton


@pytest.mark.parametrize(
    "shape", [(1,), (7,), (8,), (9,), (3, 5), (1000,), (67, 93), (2, 3, 4099), (1823, 781)]
)
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_pack_unpack_bit_exact(shape: tuple[int, ...], density: float) -> None:
    mask = torch.rand(shape) < density
    numel = mask.numel()
    packed = mask_pack_triton(mask)
    ref = mask_pack_ref(mask)
    assert packed.dtype == torch.uint8 and torch.equal(packed, ref)
    flat = mask.reshape(-1)
    assert torch.equal(mask_unpack_triton(ref, numel), flat)  # packed by torch
    assert torch.equal(mask_unpack_ref(packed, numel), flat)  # unpacked by torch
    assert torch.equal(mask_unpack_triton(packed, numel), flat)


def test_unpack_prefix_and_empty() -> None:
    mask = torch.rand(100) < 0.5
    packed = mask_pack_triton(mask)
    assert torch.equal(mask_unpack_triton(packed, 37), mask[:37])
    assert mask_unpack_triton(packed, 0).shape == (0,)
    assert mask_pack_triton(torch.zeros(0, dtype=torch.bool)).shape == (0,)


def test_dispatch_and_codec_through_triton() -> None:
    mask = torch.rand(33, 17) < 0.5
    assert torch.equal(mask_pack(mask, backend="triton"), mask_pack_ref(mask))
    packed = mask_pack(mask, backend="triton")
    assert torch.equal(mask_unpack(packed, mask.numel(), backend="triton"), mask.view(-1))
    codec = build_codec("mask", {})
    codec.backend = "triton"
    x = torch.where(mask, 0.5, -2.0).to(torch.bfloat16)  # a two-valued tensor
    assert torch.equal(codec.decode(codec.encode(x, seed=0)), x)
    assert torch.equal(codec.decode(codec.encode(mask, seed=0)), mask)


def test_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    mask = torch.rand(10, 20) < 0.5
    with pytest.raises(TypeError, match="dtype"):
        mask_pack_triton(mask.to(torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        mask_pack_triton(mask.t())
    packed = mask_pack_triton(mask)
    with pytest.raises(ValueError, match="numel=201"):
        mask_unpack_triton(packed, 201)
    with pytest.raises(TypeError, match="dtype"):
        mask_unpack_triton(packed.to(torch.int32), 200)
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        mask_pack_triton(mask)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bit_exact_large() -> None:
    mask = torch.rand(64, 1024, 1027, device="cuda") < 0.5
    packed = mask_pack_triton(mask)
    assert torch.equal(packed, mask_pack_ref(mask))
    assert torch.equal(mask_unpack_triton(packed, mask.numel()), mask.view(-1))
