"""Every codec on a CUDA device, through its default backend (Triton where a kernel
exists), against the same properties the CPU tests check and against the pure-torch
reference run on the same CUDA tensor. Skipped without a CUDA device.

Deterministic codecs (``bounded``, ``mask``, ``intpack``) must give the reference's exact
payload and decoded values; the stochastic ones (``quant``, ``division``) draw Philox
noise on the GPU, so they are checked for their bounds, NaN/inf, exact zeros and
unbiasedness instead.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_acgc.codecs import build_codec
from lightning_acgc.codecs.bounded import BoundedCodec, BoundedConfig
from lightning_acgc.codecs.quant import QuantCodec, QuantWidthConfig
from lightning_acgc.codecs.split import SplitCodec, SplitConfig
from tests import test_codec_bounded as bounded_tests
from tests import test_codec_division as division_tests
from tests import test_codec_intpack as intpack_tests
from tests import test_codec_quant as quant_tests
from tests import test_codec_split as split_tests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_GPU_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _cuda(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the GPU with its layout kept (a transposed view stays transposed)."""
    if x.dim() >= 2 and not x.is_contiguous():
        return x.t().contiguous().cuda().t() if x.dim() == 2 else x.cuda()
    return x.cuda()


def _same_payload(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        left, right = a[key], b[key]
        if left.is_floating_point():
            left, right = left + 0.0, right + 0.0  # a zero's sign may differ
        assert left.dtype == right.dtype and left.shape == right.shape, key
        assert torch.equal(left.nan_to_num(7.0), right.nan_to_num(7.0)), key


def _on_backend(codec, backend: str):
    codec.backend = backend
    return codec


# --- quant ------------------------------------------------------------------------------


@_GPU_SETTINGS
@given(
    x=quant_tests.tensors(),
    bits=st.sampled_from(quant_tests.BITS),
    group=st.sampled_from([8, 64, 256]),
    meta=st.sampled_from(["fp32", "bf16"]),
)
def test_quant_within_one_step_on_gpu(x: torch.Tensor, bits: int, group: int, meta: str) -> None:
    x = _cuda(x)
    codec = QuantCodec(QuantWidthConfig(bits=bits, group_size=group, meta=meta))
    packed = codec.encode(x, 3)
    y = codec.decode(packed)
    assert y.device == x.device
    quant_tests._assert_within_one_step(packed, x, y, group)


@pytest.mark.parametrize("meta", ["fp32", "bf16"])
@pytest.mark.parametrize("bits", quant_tests.BITS)
@pytest.mark.parametrize("name", list(quant_tests._ADVERSARIAL))
def test_quant_adversarial_on_gpu(name: str, bits: int, meta: str) -> None:
    x = _cuda(quant_tests._ADVERSARIAL[name])
    codec = QuantCodec(QuantWidthConfig(bits=bits, group_size=64, meta=meta))
    packed = codec.encode(x, 0)
    y = codec.decode(packed)
    quant_tests._assert_within_one_step(packed, x, y, 64)
    if bits > 1 and not bool((x < 0).any()):
        assert torch.equal(x == 0, y == 0)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", quant_tests.DTYPES)
def test_quant_unbiased_over_seeds_on_gpu(bits: int, dtype: torch.dtype) -> None:
    x = torch.cat([torch.randn(1000), torch.randn(1000).relu()]).to(dtype).cuda()
    codec = build_codec("quant", {"bits": bits})
    mean = torch.stack([codec.decode(codec.encode(x, s)).double() for s in range(400)]).mean(0)
    step = (x.double().max() - x.double().min()) / (2**bits - 1)
    bias = (mean - x.double()).mean().abs().item()
    assert bias < 0.01 * step.item() + 3 * torch.finfo(dtype).eps


def test_quant_same_seed_same_bytes_on_gpu() -> None:
    x = torch.randn(50, 70, device="cuda")
    codec = build_codec("quant", {"bits": 2})
    a, b, c = codec.encode(x, 7), codec.encode(x, 7), codec.encode(x, 8)
    _same_payload(a.payload, b.payload)
    assert not torch.equal(a.payload["codes"], c.payload["codes"])


# --- split ------------------------------------------------------------------------------


@_GPU_SETTINGS
@given(
    x=quant_tests.tensors(),
    bits=st.integers(2, 8),
    share=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
    group=st.sampled_from([8, 64, 256]),
)
def test_split_within_its_parts_step_on_gpu(
    x: torch.Tensor, bits: int, share: float, group: int
) -> None:
    x = _cuda(x)
    codec = SplitCodec(SplitConfig(bits=bits, low_share=share, group_size=group))
    packed = codec.encode(x, 3)
    y = codec.decode(packed)
    assert y.device == x.device and y.shape == x.shape and y.dtype == x.dtype
    finite = quant_tests._check_special(x.cpu(), y.cpu())
    if x.numel() == 0 or packed.codec == "identity":
        return
    steps = split_tests._steps(packed, x.numel(), group).cpu()
    xd, yd = x.reshape(-1).double().cpu(), y.reshape(-1).double().cpu()
    ulp = quant_tests.output_rounding(xd, yd, x.dtype)
    f = finite.reshape(-1)
    assert bool(((xd - yd).abs()[f] <= steps[f] * (1 + 1e-5) + ulp[f]).all())


def test_split_parts_are_quant_encodings_on_gpu() -> None:
    """Each part is the GPU ``quant`` encoding of its values, byte for byte."""
    x = torch.randn(7, 1000, device="cuda").relu()
    packed = SplitCodec(SplitConfig(bits=4, low_share=0.3, group_size=64)).encode(x, 11)
    k = packed.meta["split"]
    lo = QuantCodec(QuantWidthConfig(bits=3, group_size=64)).encode(x.reshape(-1)[:k], 11)
    _same_payload({n: packed.payload[f"lo.{n}"] for n in lo.payload}, lo.payload)


# --- bounded ----------------------------------------------------------------------------


@_GPU_SETTINGS
@given(
    x=bounded_tests.tensors(),
    eb=st.sampled_from([1e-6, 1e-3, 1e-2, 0.1, 10.0]),
    group=st.sampled_from([8, 64, 256]),
    relative=st.booleans(),
)
def test_bounded_matches_reference_and_bound_on_gpu(
    x: torch.Tensor, eb: float, group: int, relative: bool
) -> None:
    x = _cuda(x)
    options = BoundedConfig(error_bound=eb, group_size=group, relative=relative)
    fast = _on_backend(BoundedCodec(options), "auto")
    ref = _on_backend(BoundedCodec(options), "torch")
    packed, packed_ref = fast.encode(x, 0), ref.encode(x, 0)
    assert (packed is None) == (packed_ref is None)
    if packed is None:
        return
    assert packed.codec == packed_ref.codec
    _same_payload(packed.payload, packed_ref.payload)
    y = fast.decode(packed)
    assert torch.equal(y.nan_to_num(7.0), ref.decode(packed_ref).nan_to_num(7.0))
    if not relative:
        bounded_tests._check(x, y, eb, group)


@pytest.mark.parametrize("dtype", bounded_tests.DTYPES)
@pytest.mark.parametrize("kind", bounded_tests.KINDS)
def test_bounded_every_kind_on_gpu(kind: str, dtype: torch.dtype) -> None:
    x = bounded_tests._make(kind, (257, 129), dtype, 5).cuda()
    codec = BoundedCodec(BoundedConfig(error_bound=1e-2, group_size=256))
    y = codec.decode(codec.encode(x, 0))
    bounded_tests._check(x, y, 1e-2, 256)


# --- division ---------------------------------------------------------------------------


@_GPU_SETTINGS
@given(case=division_tests.round_trip_cases())
def test_division_within_bound_on_gpu(case: tuple[torch.Tensor, dict[str, int], int]) -> None:
    x, options, seed = case
    x = x.cuda()
    packed, y = division_tests._round_trip(build_codec("division", options), x, seed=seed)
    division_tests._assert_within_bound(x, y, packed)


@pytest.mark.parametrize("dtype", division_tests.DTYPES)
def test_division_nan_inf_and_relu_zeros_on_gpu(dtype: torch.dtype) -> None:
    x = torch.randn(2, 8, 13, 13).relu()
    x[0, 0, 0, :5] = torch.tensor([1e-4, 2e-4, 0.0, 3e-4, 1e-4])
    x[1, 1] *= 100.0
    x = x.to(dtype).cuda()
    packed, y = division_tests._round_trip(build_codec("division", {"group_size": 64}), x, 5)
    assert torch.equal(y == 0, x == 0)
    assert bool((y[x > 0] > 0).all())
    division_tests._assert_within_bound(x, y, packed)
    x = x.clone()
    x[0, 0, 0, 0], x[1, 2, 8:, 8:], x[1, 0, :8, :8] = torch.nan, torch.inf, -torch.inf
    _, y = division_tests._round_trip(build_codec("division", {"group_size": 64}), x, 5)
    assert torch.equal(y.isnan(), x.isnan())
    assert torch.equal(y.isposinf(), x.isposinf()) and torch.equal(y.isneginf(), x.isneginf())
    assert bool(y[x.isfinite()].isfinite().all())


def test_division_channels_last_and_empty_on_gpu() -> None:
    x = torch.randn(2, 6, 16, 16, device="cuda").to(memory_format=torch.channels_last)
    codec = build_codec("division", {"group_size": 32})
    packed, y = division_tests._round_trip(codec, x, seed=3)
    division_tests._assert_within_bound(x, y, packed)
    empty = torch.empty(0, 3, 8, 8, device="cuda")
    packed = codec.encode(empty, 0)
    assert packed is None or codec.decode(packed).shape == empty.shape


# --- mask and intpack -------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (64, 1027), (3, 5, 333)])
def test_mask_matches_reference_on_gpu(shape: tuple[int, ...]) -> None:
    x = torch.rand(shape, device="cuda") < 0.4
    fast, ref = _on_backend(build_codec("mask"), "auto"), _on_backend(build_codec("mask"), "torch")
    packed, packed_ref = fast.encode(x, 0), ref.encode(x, 0)
    assert (packed is None) == (packed_ref is None)
    if packed is not None:
        _same_payload(packed.payload, packed_ref.payload)
        assert torch.equal(fast.decode(packed), x)
    two_valued = torch.where(x, 2.5, -1.0).t() if x.dim() == 2 else torch.where(x, 2.5, -1.0)
    packed = fast.encode(two_valued, 0)
    if packed is not None:
        assert torch.equal(fast.decode(packed), two_valued)


@_GPU_SETTINGS
@given(x=intpack_tests.int_tensors(), group=st.sampled_from([8, 64, 256]))
def test_intpack_lossless_on_gpu(x: torch.Tensor, group: int) -> None:
    x = x.cuda()
    codec = build_codec("intpack", {"group_size": group})
    packed = codec.encode(x, 0)
    if packed is None:
        return
    y = codec.decode(packed)
    assert y.dtype == x.dtype and y.shape == x.shape and y.device == x.device
    assert torch.equal(y, x)


def test_bf16_metadata_is_written_as_fp32_by_the_triton_kernel() -> None:
    from lightning_acgc.kernels.quant import quant_decode, quant_encode

    x = torch.randn(64, 1000, device="cuda").relu()
    fast = quant_encode(x, 2, 256, 0, meta="bf16")
    assert fast["lo"].dtype == torch.float32 and fast["scale"].dtype == torch.float32
    ref = quant_encode(x, 2, 256, 0, backend="torch", meta="bf16")
    assert ref["lo"].dtype == torch.bfloat16
    for payload in (fast, ref):
        y = quant_decode(payload, 2, 256, x.numel(), x.dtype).view(x.shape)
        assert torch.equal(y == 0, x == 0)
    # float32 steps are never coarser than the bfloat16 ones (rounded up)
    assert bool((fast["scale"].abs() <= ref["scale"].float().abs() * (1 + 1e-6)).all())
