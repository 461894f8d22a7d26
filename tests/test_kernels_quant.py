"""Triton ``quant`` kernels against the torch reference (CPU: under TRITON_INTERPRET=1).

With injected noise the kernel's payload must equal the reference's bit for bit; with
its own Philox noise the codes differ from torch's generator, so those tests check the
properties instead (one step of error, unbiased, zeros kept, deterministic per seed).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_acgc.codecs import build_codec
from lightning_acgc.codecs.quant import QuantCodec, QuantWidthConfig
from lightning_acgc.kernels.common import triton_utils as _triton_utils
from lightning_acgc.kernels.quant import (
    quant_decode,
    quant_decode_ref,
    quant_encode,
    quant_encode_ref,
)
from lightning_acgc.kernels.quant.triton import quant_decode_triton, quant_encode_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = [1, 2, 3, 4, 5, 6, 7, 8]
_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of ``t`` (so that -0.0 != 0.0 and NaN == NaN of the same payload)."""
    return t.contiguous().view(_INT_OF[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype, shape, device and bits."""
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    assert torch.equal(_bits(a), _bits(b))


def assert_same_payload(p: dict[str, torch.Tensor], r: dict[str, torch.Tensor]) -> None:
    """Bit-identical payloads, except the sign of a zero ``lo`` where a group's minimum is
    a zero of both signs: which one a min returns is up to the reduction (torch's too);
    both decode alike."""
    assert list(p) == list(r)
    for key in r:
        if key == "lo":
            assert_same(p[key] + 0.0, r[key] + 0.0)
        else:
            assert_same(p[key], r[key])


def _groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def _activations(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of different kinds: signed, post-ReLU (zero-kept groups), constant, all-zero,
    one positive among zeros, tiny and large ranges."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).view(-1)
    n = x.numel()
    part = max(1, n // 8)
    x[:part] = x[:part].clamp(min=0)  # ReLU output
    x[part : 2 * part] = 0.75  # constant
    x[2 * part : 3 * part] = 0.0  # all zero
    x[3 * part : 4 * part] = x[3 * part : 4 * part].clamp(min=0) * 1e-3
    x[4 * part : 5 * part] *= 100.0
    x[5 * part : 6 * part] = 0.0
    x[5 * part : 6 * part : 97] = 2.5  # a few positives among zeros
    return x.view(shape).to(dtype)


def _check_roundtrip(x: torch.Tensor, bits: int, group_size: int) -> None:
    """Bit-exact encode with injected noise, and decode/cross-decode into every dtype."""
    noise = torch.rand(_groups(x.numel(), group_size), group_size)
    ref = quant_encode_ref(x, bits, group_size, seed=7, noise=noise)
    tri = quant_encode_triton(x, bits, group_size, seed=7, noise=noise)
    assert_same_payload(tri, ref)
    dec_ref = quant_decode_ref(ref, bits, group_size, x.numel(), x.dtype)
    assert_same(quant_decode_triton(ref, bits, group_size, x.numel(), x.dtype), dec_ref)
    torch.testing.assert_close(
        quant_decode_triton(tri, bits, group_size, x.numel(), x.dtype), dec_ref, atol=0, rtol=0
    )


@pytest.mark.parametrize("group_size", [64, 256])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_decode_bit_exact(dtype: torch.dtype, bits: int, group_size: int) -> None:
    # 67 * 93 = 6231: a tail of 23 values at group 64 and of 87 at group 256.
    _check_roundtrip(_activations((67, 93), dtype), bits, group_size)


@pytest.mark.parametrize(
    ("dtype", "bits", "group_size"),
    [(torch.float32, 2, 256), (torch.bfloat16, 4, 64), (torch.float16, 1, 256)],
)
def test_irregular_large_shape(dtype: torch.dtype, bits: int, group_size: int) -> None:
    _check_roundtrip(_activations((1823, 781), dtype, seed=1), bits, group_size)


@pytest.mark.parametrize("numel", [1, 5, 63, 64, 65, 255, 257])
@pytest.mark.parametrize("group_size", [40, 64, 256])  # 40: not a power of two
def test_tails_and_tiny_tensors(numel: int, group_size: int) -> None:
    x = torch.randn(numel)
    for bits in (2, 8):
        _check_roundtrip(x, bits, group_size)
        _check_roundtrip(x.clamp(min=0), bits, group_size)


@pytest.mark.parametrize("out", [*DTYPES, torch.float64])
def test_decode_into_any_dtype(out: torch.dtype) -> None:
    """Decoding into another dtype (float64 included) matches the reference too."""
    x = _activations((33, 77), torch.float32)
    payload = quant_encode_ref(x, 4, 64, seed=3)
    assert_same(
        quant_decode_triton(payload, 4, 64, x.numel(), out),
        quant_decode_ref(payload, 4, 64, x.numel(), out),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("last_special", [False, True])
def test_nonfinite_values(dtype: torch.dtype, last_special: bool) -> None:
    x = torch.randn(1000).to(dtype)
    x[3], x[500], x[501] = float("nan"), float("inf"), -float("inf")
    x[128:192] = float("nan")  # a group without any finite value
    if last_special:
        x[-1] = float("nan")  # the tail padding copies it
    for bits, group_size in ((2, 64), (8, 256)):
        noise = torch.rand(_groups(x.numel(), group_size), group_size)
        ref = quant_encode_ref(x, bits, group_size, 1, noise=noise)
        tri = quant_encode_triton(x, bits, group_size, 1, noise=noise)
        assert_same_payload(tri, ref)
        y = quant_decode_triton(tri, bits, group_size, x.numel(), dtype)
        assert_same(y, quant_decode_ref(ref, bits, group_size, x.numel(), dtype))
        special = ~torch.isfinite(x)  # (the NaN payload bits may change, as in the reference)
        torch.testing.assert_close(y[special], x[special], atol=0, rtol=0, equal_nan=True)
        # Philox noise: exceptions are the same, only the codes differ.
        philox = quant_encode_triton(x, bits, group_size, 1)
        assert_same(philox["exc_idx"], ref["exc_idx"])
        assert_same(philox["exc_val"], ref["exc_val"])


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("case", ["huge_range", "subnormal_step"])
@pytest.mark.parametrize("bits", [1, 2, 8])
def test_float64_cases_match_reference(case: str, bits: int) -> None:
    """A group range above float32's max, or a subnormal step whose inverse overflows: the
    reference goes float64, so does the kernel path (encode by the reference, decode by the
    kernel's float64 branch where lo + levels * step overflows)."""
    if case == "huge_range":
        x = torch.randn(1000) * 1e37
        x[7], x[8] = 3e38, -3e38
    else:
        x = torch.randn(1000) * 1e-40
        x[500:600] = x[500:600].abs()
    noise = torch.rand(16, 64)
    ref = quant_encode_ref(x, bits, 64, 1, noise=noise)
    tri = quant_encode_triton(x, bits, 64, 1, noise=noise)
    assert_same_payload(tri, ref)
    for out in (*DTYPES, torch.float64):
        # (1 bit over a range beyond float32 stores scale = inf, and the reference decodes
        # code 0 to 0 * inf = NaN; a NaN's bits depend on the conversion path, so compare
        # NaN as NaN)
        torch.testing.assert_close(
            quant_decode_triton(ref, bits, 64, x.numel(), out),
            quant_decode_ref(ref, bits, 64, x.numel(), out),
            atol=0,
            rtol=0,
            equal_nan=True,
        )


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("backend", ["triton", "cpu", "torch"])
def test_reject_inf_steps(backend: str) -> None:
    """A 1-bit step over a range beyond float32 is stored as inf: with reject_inf_steps
    the encode says so with None (the Triton and CPU paths check only their reference
    fallback), and the codec keeps such a tensor raw; 2 bits over the range still fit."""
    x = torch.randn(1000) * 1e37
    x[7], x[8] = 3e38, -3e38
    kept = quant_encode(x, 1, 64, 1, backend=backend)
    assert not bool(torch.isfinite(kept["scale"]).all())
    assert quant_encode(x, 1, 64, 1, backend=backend, reject_inf_steps=True) is None
    two = quant_encode(x, 2, 64, 1, backend=backend, reject_inf_steps=True)
    assert two is not None and bool(torch.isfinite(two["scale"]).all())
    codec = QuantCodec(QuantWidthConfig(bits=1, group_size=64))
    codec.backend = backend
    packed = codec.encode(x, seed=1)
    assert packed.codec == "identity" and torch.equal(codec.decode(packed), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_into_a_slice(dtype: torch.dtype) -> None:
    """``out``: the kernel writes the slice in place (no new tensor), NaN/inf restored
    there, the values around it untouched; a wrong ``out`` is refused."""
    x = _activations((30, 70), dtype)
    x[5] = float("nan")
    payload = quant_encode_triton(x.view(-1), 4, 64, seed=2)
    want = quant_decode_ref(payload, 4, 64, x.numel(), dtype)
    buf = torch.full((x.numel() + 40,), 7.0, dtype=dtype)
    out = buf[24 : 24 + x.numel()]
    got = quant_decode(payload, 4, 64, x.numel(), dtype, backend="triton", out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_same(out, want)
    assert bool((buf[:24] == 7).all()) and bool((buf[24 + x.numel() :] == 7).all())
    with pytest.raises(ValueError, match="out must be a flat"):
        quant_decode_triton(payload, 4, 64, x.numel(), dtype, out=buf[: x.numel() - 1])
    with pytest.raises(ValueError, match="out must be a flat"):
        quant_decode_triton(payload, 4, 64, x.numel(), torch.float16, out=out)


def _step(payload: dict[str, torch.Tensor], group_size: int, numel: int) -> torch.Tensor:
    return payload["scale"].abs().repeat_interleave(group_size)[:numel]


@pytest.mark.parametrize("bits", BITS)
def test_philox_codes_are_unbiased_within_one_step(bits: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 48 + 17, generator=gen)
    relu = torch.arange(x.numel()) < 64 * 16
    x[relu] = x[relu].clamp(min=0)  # zero-kept groups too
    group_size, seeds = 64, 48
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for seed in range(seeds):
        payload = quant_encode_triton(x, bits, group_size, seed)
        y = quant_decode_triton(payload, bits, group_size, x.numel(), torch.float32)
        step = _step(payload, group_size, x.numel())
        assert bool(((y - x).abs() <= step + 1e-6 * x.abs()).all())
        if bits > 1:  # in zero-kept groups zeros stay zeros, positives stay positive
            assert bool((y[relu & (x == 0)] == 0).all()) and bool((y[relu & (x > 0)] > 0).all())
        total += y.double()
    # Each decode is x plus zero-mean error of std <= step / 2: the mean over seeds and
    # elements is within a few standard errors of x.
    step = _step(quant_encode_ref(x, bits, group_size, 0), group_size, x.numel()).double()
    err = (total / seeds - x.double()) / step.clamp(min=1e-30)
    moving = step > 0
    sigma = 0.5 / math.sqrt(seeds)
    assert err[moving].abs().max() < 6 * sigma
    assert abs(float(err[moving].mean())) < 6 * sigma / math.sqrt(int(moving.sum()))


def test_philox_deterministic_and_independent_of_block_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(3000)
    first = quant_encode_triton(x, 2, 64, seed=11)
    assert_same_payload(quant_encode_triton(x, 2, 64, seed=11), first)
    other = quant_encode_triton(x, 2, 64, seed=12)
    assert not torch.equal(other["codes"], first["codes"])
    big_seed = quant_encode_triton(x, 2, 64, seed=2**40 + 11)
    assert not torch.equal(big_seed["codes"], first["codes"])
    # Fewer groups per program: the noise belongs to the element, not to the block.
    monkeypatch.setattr(_triton_utils, "_BLOCK_ELEMS_INTERPRETER", 128)
    assert_same_payload(quant_encode_triton(x, 2, 64, seed=11), first)


def test_dispatch_and_codec_through_triton() -> None:
    x = _activations((40, 50), torch.float16)
    tri = quant_encode(x, 4, 64, seed=5, backend="triton")
    assert_same_payload(tri, quant_encode_triton(x, 4, 64, seed=5))
    assert_same(
        quant_decode(tri, 4, 64, x.numel(), x.dtype, backend="triton"),
        quant_decode(tri, 4, 64, x.numel(), x.dtype, backend="torch"),
    )
    codec = build_codec("quant", {"bits": 4, "group_size": 64})
    codec.backend = "triton"
    packed = codec.encode(x, seed=5)
    assert_same_payload(packed.payload, tri)
    y = codec.decode(packed)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_eager_launches_skip_the_higher_order_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside ``torch.compile`` a launch goes straight to the Triton kernel: each
    ``wrap_triton`` the launchers make runs with torch's higher-order-op dispatch off
    (left on, it costs about 0.85 ms of host time a launch on a GPU machine)."""
    import importlib

    from torch._library.triton import is_wrap_triton_enabled

    seen: list[bool] = []

    def recording(kernel: object) -> object:
        seen.append(is_wrap_triton_enabled())
        return torch.library.wrap_triton(kernel)

    for family in ("quant", "bounded", "division", "mask", "channels"):
        module = importlib.import_module(f"lightning_acgc.kernels.{family}.triton")
        monkeypatch.setattr(module, "wrap_triton", recording, raising=False)
    monkeypatch.setattr(_triton_utils, "wrap_triton", recording, raising=False)
    x = _activations((40, 50), torch.float32)
    codecs = [QuantCodec(QuantWidthConfig(bits=b, group_size=64)) for b in (2, 3)]
    codecs += [build_codec(name, {}) for name in ("bounded", "division", "mask")]
    inputs = [x, x, x, x.relu().reshape(2, 4, 10, 25), x > 0]
    for codec, t in zip(codecs, inputs, strict=True):
        codec.backend = "triton"
        codec.decode(codec.encode(t, seed=5))
    from lightning_acgc.kernels.channels import normalize_channels

    normalize_channels(x.reshape(2, 4, 10, 25), backend="triton")
    assert seen and not any(seen), seen


def test_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(10, 20)
    with pytest.raises(ValueError, match="contiguous"):
        quant_encode_triton(x.t(), 2, 64, 0)
    with pytest.raises(TypeError, match="dtype"):
        quant_encode_triton(x.double(), 2, 64, 0)
    with pytest.raises(ValueError, match="bits=9"):
        quant_encode_triton(x, 9, 64, 0)
    with pytest.raises(ValueError, match="group_size=12"):
        quant_encode_triton(x, 2, 12, 0)
    with pytest.raises(ValueError, match="empty"):
        quant_encode_triton(x[:0], 2, 64, 0)
    with pytest.raises(ValueError, match="noise must have shape"):
        quant_encode_triton(x, 2, 64, 0, noise=torch.rand(3, 64))
    payload = quant_encode_ref(x, 2, 64, 0)
    with pytest.raises(ValueError, match="numel=1000"):
        quant_decode_triton(payload, 2, 64, 1000, torch.float32)
    with pytest.raises(ValueError, match="payload sizes"):
        quant_decode_triton(payload, 4, 64, 200, torch.float32)
    with pytest.raises(TypeError, match=r"dtype=torch\.int32"):
        quant_decode_triton(payload, 2, 64, 200, torch.int32)
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        quant_encode_triton(x, 2, 64, 0)


_TRACE = """
import torch
from torch._functorch.aot_autograd import aot_module_simplified
from lightning_acgc.kernels.mask.triton import _mask_pack_core
from lightning_acgc.kernels.quant.triton import _quant_decode_core, _quant_encode_core

graphs = []

class NotRun(Exception):
    pass

def backend(gm, inputs):  # keep the traced graphs; never run them (no GPU here)
    def keep(fw, _):
        graphs.append(fw.code)
        def run(*args):
            raise NotRun
        return run
    return aot_module_simplified(gm, inputs, fw_compiler=keep)

def codec(x):
    codes, lo, scale, status = _quant_encode_core(x, None, 4, 64, 7)
    y = _quant_decode_core(codes, lo, scale, 4, 64, x.numel(), torch.bfloat16)
    return y, status, _mask_pack_core((x > 0).view(torch.uint8))

try:
    torch.compile(codec, backend=backend, fullgraph=True)(torch.randn(1000))
except NotRun:
    pass
# encode 1, decode 2 (its float64 switch, then the decode), mask 1
assert graphs[0].count("triton_kernel_wrapper_functional(") == 4, graphs[0]
"""


def test_ops_trace_under_torch_compile() -> None:
    """The ``torch.library.triton_op`` launchers trace into Triton kernel nodes with
    ``fullgraph=True`` (what Inductor compiles). The interpreter's kernels cannot be traced,
    so this runs without it, tracing only."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _TRACE], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_gpu_bit_exact_against_cuda_reference(dtype: torch.dtype, bits: int) -> None:
    x = _activations((1823, 781), dtype).cuda()
    for group_size in (64, 256):
        noise = torch.rand(_groups(x.numel(), group_size), group_size, device="cuda")
        ref = quant_encode_ref(x, bits, group_size, 3, noise=noise)
        tri = quant_encode_triton(x, bits, group_size, 3, noise=noise)
        assert_same_payload(tri, ref)
        assert_same(
            quant_decode_triton(ref, bits, group_size, x.numel(), dtype),
            quant_decode_ref(ref, bits, group_size, x.numel(), dtype),
        )


@pytest.mark.gpu
@_cuda
def test_gpu_decode_traces_under_torch_compile() -> None:
    x = torch.randn(1823, 781, device="cuda")
    payload = quant_encode_triton(x, 4, 256, 0)

    def decode(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        p = {"codes": codes, "lo": lo, "scale": scale}
        p["exc_idx"], p["exc_val"] = payload["exc_idx"], payload["exc_val"]
        return quant_decode_triton(p, 4, 256, x.numel(), torch.bfloat16) * 2

    compiled = torch.compile(decode, fullgraph=True)
    args = (payload["codes"], payload["lo"], payload["scale"])
    assert_same(compiled(*args), decode(*args))


@pytest.mark.gpu
@_cuda
def test_gpu_encode_faster_than_reference() -> None:
    x = torch.randn(64, 1024, 1024, device="cuda", dtype=torch.bfloat16)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    t_tri = timed(lambda: quant_encode_triton(x, 2, 256, 0))
    t_ref = timed(lambda: quant_encode_ref(x, 2, 256, 0))
    assert t_tri < t_ref
