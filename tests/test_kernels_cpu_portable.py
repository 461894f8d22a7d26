"""The compiled CPU kernels built for a CPU without AVX-512 (``-march=x86-64-v2``, and
``-march=haswell`` where the host runs AVX2): the paths the build machine's own flags skip
(the C kernels' AVX-512 VBMI byte permutations of the 3/5/6/7-bit streams and its AVX-512
statistics and zero bits have portable twins; division's AVX2 block averages of rows that
are not whole tiles run without AVX-512 on an AVX2 CPU) give the reference's bytes too."""

from __future__ import annotations

import math
import platform

import pytest
import torch

from lightning_acgc.kernels.bounded.reference import bounded_encode_ref
from lightning_acgc.kernels.common import cpu_lib
from lightning_acgc.kernels.quant.reference import quant_decode_ref, quant_encode_ref

pytestmark = pytest.mark.skipif(
    cpu_lib.cpu_library() is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs a C compiler and an x86-64 host",
)


def _host_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(ln.startswith("flags") and flag in ln.split() for ln in f)
    except OSError:
        return False


_TARGETS = [
    "x86-64-v2",
    pytest.param(
        "haswell", marks=pytest.mark.skipif(not _host_has("avx2"), reason="needs an AVX2 host")
    ),
]


@pytest.fixture(scope="module", params=_TARGETS)
def portable_library(request, tmp_path_factory):
    """The kernels compiled with ``-march=<target>`` into a fresh cache, in use by the
    quant, bounded, division and intpack CPU paths for the tests of this module."""
    patch = pytest.MonkeyPatch()
    flags = [f if f != "-march=native" else f"-march={request.param}" for f in cpu_lib._FLAGS]
    assert flags != cpu_lib._FLAGS  # the native build names -march=native
    patch.setattr(cpu_lib, "_FLAGS", flags)
    patch.setenv("LIGHTNING_ACGC_CACHE", str(tmp_path_factory.mktemp("portable")))
    lib = cpu_lib.cpu_library.__wrapped__()
    assert lib is not None
    import lightning_acgc.kernels.bounded.cpu as bounded_cpu
    import lightning_acgc.kernels.division.cpu as division_cpu
    import lightning_acgc.kernels.intpack.cpu as intpack_cpu
    import lightning_acgc.kernels.quant.cpu as quant_cpu

    for module in (quant_cpu, bounded_cpu, division_cpu, intpack_cpu):
        patch.setattr(module, "cpu_library", lambda: lib)
    yield lib
    patch.undo()


def _relu_tensor() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70001, generator=g)  # whole CHUNKs, 64-byte blocks and an odd tail
    x[:30000] = x[:30000].relu()
    return x


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_portable_quant_matches_reference(portable_library, bits: int) -> None:
    from lightning_acgc.kernels.quant.cpu import quant_decode_cpu, quant_encode_cpu

    x = _relu_tensor()
    for group_size in (64, 256, 4096):
        ref = quant_encode_ref(x, bits, group_size, seed=5, meta="bf16")
        got = quant_encode_cpu(x, bits, group_size, seed=5, meta="bf16")
        assert ref.keys() == got.keys()
        for k in ref:
            a, b = (t.reshape(-1).view(torch.uint8) for t in (ref[k], got[k]))
            assert ref[k].dtype == got[k].dtype and torch.equal(a, b), k
        out = quant_decode_cpu(ref, bits, group_size, x.numel(), torch.float32)
        expected = quant_decode_ref(ref, bits, group_size, x.numel(), torch.float32)
        assert torch.equal(out, expected)


def test_portable_bounded_matches_reference(portable_library) -> None:
    from lightning_acgc.kernels.bounded.cpu import bounded_encode_cpu

    x = _relu_tensor() * 3.0
    ref = bounded_encode_ref(x, 1e-2, 256, relative=True)
    got = bounded_encode_cpu(x, 1e-2, 256, relative=True)
    assert ref.keys() == got.keys()
    for k in ref:  # NaN-safe where a view as bytes is possible (0-d bounds compare as is)
        a, b = (t.reshape(-1).view(torch.uint8) for t in (ref[k], got[k]))
        assert ref[k].dtype == got[k].dtype and torch.equal(a, b), k


@pytest.mark.parametrize(
    "shape", [(70001,), (2, 16, 40, 48), (3, 5, 13, 22), (2, 4, 28, 28), (1, 2, 9, 75)], ids=str
)
def test_portable_division_matches_reference(portable_library, shape) -> None:
    from lightning_acgc.kernels.division import division_decode_ref, division_encode_ref
    from lightning_acgc.kernels.division.cpu import _decode_fused, _encode_fused

    x = _relu_tensor()[: math.prod(shape)].reshape(shape)
    for low_dtype in (torch.bfloat16, torch.float32):
        ref = division_encode_ref(x, 8, 2, 256, low_dtype, 3)
        got = _encode_fused(x, 8, 2, 256, low_dtype, 3)
        assert got is not None and ref.keys() == got.keys()
        for k in ref:
            a, b = (t.reshape(-1).view(torch.uint8) for t in (ref[k], got[k]))
            assert ref[k].dtype == got[k].dtype and torch.equal(a, b), k
        out = _decode_fused(ref, x.shape, torch.float32, 8, 2, 256)
        assert out is not None
        assert torch.equal(out, division_decode_ref(ref, x.shape, torch.float32, 8, 2, 256))


def test_portable_squared_sum_matches_torch(portable_library, monkeypatch) -> None:
    import lightning_acgc.kernels.common.sums as sums

    monkeypatch.setattr(sums, "cpu_library", lambda: portable_library)
    x = _relu_tensor()
    y = x.flip(0)
    for v, w in ((x, None), (x, y), (x[:9], y[:9]), (x[3:].reshape(-1, 2).t(), None)):
        assert sums.squared_sum(v, w) == pytest.approx(sums.squared_sum_ref(v, w), rel=1e-12)


def test_portable_mask_two_matches_reference(portable_library, monkeypatch) -> None:
    import lightning_acgc.kernels.mask.cpu as mask_cpu
    from lightning_acgc.kernels.mask.reference import mask_select_ref, mask_two_ref

    monkeypatch.setattr(mask_cpu, "cpu_library", lambda: portable_library)
    m = (_relu_tensor() > 0).float() * 1.25
    m[11::997] = float("nan")
    for v in (m, m[:9], m[1:1004], m[3:].reshape(-1, 2).t()):
        bits, other = mask_cpu.mask_two_cpu(v, 0.0, 1.25)
        ref_bits, ref_other = mask_two_ref(v, 0.0, 1.25)
        assert torch.equal(bits, ref_bits) and other == ref_other
        n = v.numel()
        out = mask_cpu.mask_select_cpu(bits, n, 0.0, 1.25)
        assert torch.equal(out, mask_select_ref(bits, n, 0.0, 1.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_portable_nonzero_matches_reference(portable_library, monkeypatch, dtype) -> None:
    import lightning_acgc.kernels.nonzero.cpu as nonzero_cpu
    from lightning_acgc.kernels.nonzero.reference import nonzero_merge_ref, nonzero_split_ref

    monkeypatch.setattr(nonzero_cpu, "cpu_library", lambda: portable_library)
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    x = _relu_tensor().to(dtype)
    x[::97] = -0.0
    x[5::101] = float("nan")
    x[7::103] = float("-inf")
    x[9::107] = torch.finfo(dtype).tiny / 4  # denormals
    x[40000:40100] = 0.0  # an all-zero stretch, then a dense one
    x[40100:40300] = 1.5
    for threads in (1, 3):
        monkeypatch.setattr(nonzero_cpu, "cpu_threads", lambda threads=threads: threads)
        for v in (x, x[:1], x[:9], x[:1003], x[3:].reshape(-1, 2).t()):
            bits, values = nonzero_cpu.nonzero_split_cpu(v)
            ref_bits, ref_values = nonzero_split_ref(v)
            assert torch.equal(bits, ref_bits)
            assert torch.equal(values.view(ints), ref_values.view(ints))
            n = v.numel()
            out = nonzero_cpu.nonzero_merge_cpu(bits, values, n)
            assert torch.equal(out.view(ints), v.reshape(-1).view(ints))
            assert torch.equal(out.view(ints), nonzero_merge_ref(bits, values, n).view(ints))


@pytest.mark.parametrize(
    ("shape", "k", "stride", "pad"),
    [((2, 8, 32, 32), 2, 2, 0), ((2, 4, 112, 112), 3, 2, 1), ((1, 5, 33, 17), 3, 3, 0),
     ((3, 2, 16, 20), 5, 2, 2), ((2, 3, 9, 9), 3, 2, 1)],
)  # fmt: skip
def test_portable_window_matches_reference(portable_library, shape, k, stride, pad) -> None:
    """Max-pool indices in intpack's window mode: the portable offsets and codes give the
    reference's bytes, and a value outside its window declines as the reference does."""
    from lightning_acgc.kernels.intpack.cpu import window_encode_cpu
    from lightning_acgc.kernels.intpack.window import window_encode_ref, window_fit

    torch.manual_seed(0)
    _, idx = torch.nn.functional.max_pool2d(torch.randn(shape), k, stride, pad, return_indices=True)
    fit = window_fit(idx)
    ref, got = window_encode_ref(idx, *fit), window_encode_cpu(idx, *fit)
    assert ref.keys() == got.keys() and all(torch.equal(ref[key], got[key]) for key in ref)
    bad = idx.clone()
    bad.view(-1)[-1] += 10**6
    assert window_encode_ref(bad, *fit) is None and window_encode_cpu(bad, *fit) is None
