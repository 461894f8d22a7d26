"""The ``nonzero`` kernels: the compiled CPU path against the pure-torch reference, bit for
bit (bits as bytes, values as integers: NaN payloads and -0.0 compared exactly), exact
round trips, the router's choice and the argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_acgc.kernels.nonzero as nonzero
import lightning_acgc.kernels.nonzero.cpu as nonzero_cpu
from lightning_acgc.kernels.common import cpu_lib
from lightning_acgc.kernels.nonzero import (
    nonzero_count,
    nonzero_merge,
    nonzero_merge_ref,
    nonzero_split,
    nonzero_split_ref,
)
from lightning_acgc.kernels.nonzero.cpu import nonzero_merge_cpu, nonzero_split_cpu

needs_lib = pytest.mark.skipif(cpu_lib.cpu_library() is None, reason="no C compiler here")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
# bit patterns of NaNs with payloads (quiet, signalling, negative) and of denormals
_SPECIAL_BITS = {
    torch.float32: [0x7FC00001, 0x7F800001, 0xFFC12345, 0x00000001, 0x807FFFFF],
    torch.float16: [0x7E01, 0x7C01, 0xFE02, 0x0001, 0x83FF],
    torch.bfloat16: [0x7FC1, 0x7F81, 0xFFC1, 0x0001, 0x807F],
}


def _ints(t: torch.Tensor) -> torch.Tensor:
    """The flat bit patterns of ``t``: equal exactly when the values are the same bits."""
    return t.reshape(-1).view(_INT[t.dtype])


def _specials(dtype: torch.dtype, n: int) -> torch.Tensor:
    """NaN payloads, +-inf, +-0.0 and denormals, repeated to ``n`` elements."""
    width = 8 * dtype.itemsize
    signed = [b - (1 << width) if b >> (width - 1) else b for b in _SPECIAL_BITS[dtype]]
    bits = torch.tensor(signed, dtype=_INT[dtype]).view(dtype)
    rest = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 1.0, 0.0], dtype=dtype)
    return torch.cat([bits, rest]).repeat(-(-n // 11))[:n]


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    relu = torch.randn(67, 93, generator=g).relu().to(dtype)
    wide = torch.randn(40, 70, generator=g).relu().to(dtype)
    return {
        "relu": relu,
        "zeros": torch.zeros(1000, dtype=dtype),
        "no_zeros": torch.randn(1000, generator=g).abs().add(0.5).to(dtype),
        "neg_zero": torch.tensor([-0.0, 0.0, -0.0, 2.0, 0.0, -0.0, -0.0, 0.0, 0.0], dtype=dtype),
        "specials": _specials(dtype, 1000),
        "n1": torch.tensor([3.0], dtype=dtype),
        "n1_zero": torch.zeros(1, dtype=dtype),
        "n7": torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 0.0, 4.0], dtype=dtype),
        "n9": torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0], dtype=dtype),
        "n1003": torch.randn(1003, generator=g).relu().to(dtype),
        "scalar": torch.tensor(2.5, dtype=dtype),
        "scalar_zero": torch.tensor(0.0, dtype=dtype),
        "empty": torch.zeros(0, 3, dtype=dtype),
        "transposed": wide.t(),
        "strided": wide[::3, 1::2],
        "large": torch.randn(3_000_001, generator=g).relu().to(dtype),
    }


def _same_split(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    assert a[0].dtype == b[0].dtype == torch.uint8 and torch.equal(a[0], b[0])
    assert a[1].dtype == b[1].dtype and a[1].dim() == b[1].dim() == 1
    assert torch.equal(_ints(a[1]), _ints(b[1]))


def _expected_split(x: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The format written out element by element: the spec the reference is held to."""
    flat = _ints(x.contiguous())
    keep = [int(v) != 0 for v in flat.tolist()]
    packed = [0] * (-(-len(keep) // 8))
    for i, k in enumerate(keep):
        packed[i // 8] |= int(k) << (i % 8)
    return packed, flat[torch.tensor(keep, dtype=torch.bool)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_is_the_documented_format(dtype: torch.dtype) -> None:
    for name, x in _inputs(dtype).items():
        if x.numel() > 10_000:
            continue
        bits, values = nonzero_split_ref(x)
        packed, kept = _expected_split(x)
        assert bits.tolist() == packed, name
        assert values.dtype == dtype and torch.equal(_ints(values), kept), name
    bits, values = nonzero_split_ref(torch.tensor([0.0, 1.0, -0.0, 0.0, 0, 0, 0, 0, 7.0]))
    assert bits.tolist() == [6, 1] and values.tolist() == [1.0, -0.0, 7.0]
    assert str(values[1].item()) == "-0.0"


@needs_lib
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_split_and_merge_bit_identical_to_reference(dtype: torch.dtype) -> None:
    for name, x in _inputs(dtype).items():
        ref = nonzero_split_ref(x)
        got = nonzero_split_cpu(x)
        _same_split(got, ref)
        assert got[1].numel() == nonzero_count(got[0], x.numel()), name
        n = x.numel()
        flat = _ints(x.contiguous())
        for bits, values in (ref, got):  # each path merges the other's split
            for merge in (nonzero_merge_ref, nonzero_merge_cpu):
                y = merge(bits, values, n)
                assert y.shape == (n,) and y.dtype == dtype, name
                assert torch.equal(_ints(y), flat), (name, merge.__name__)


@needs_lib
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.5, 0.98, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_chunks_over_threads(monkeypatch, dtype, density: float, threads: int) -> None:
    """Chunk boundaries and each chunk's last rows (whole-row stores up to the next
    chunk's values), at every density and thread count."""
    monkeypatch.setattr(nonzero_cpu, "cpu_threads", lambda: threads)
    g = torch.Generator().manual_seed(threads)
    n = 100_003  # past the one-thread size, an odd tail
    x = torch.randn(n, generator=g).abs().add(0.1).to(dtype)
    x[torch.rand(n, generator=g) >= density] = 0.0
    got = nonzero_split_cpu(x)
    _same_split(got, nonzero_split_ref(x))
    assert torch.equal(_ints(nonzero_merge_cpu(*got, n)), _ints(x))


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_lib), "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_into_out(dtype: torch.dtype, backend: str) -> None:
    x = _specials(dtype, 4097).reshape(17, 241).t()  # non-contiguous
    bits, values = nonzero_split(x, backend=backend)
    out = torch.full((x.numel(),), 9.0, dtype=dtype)  # stale values to overwrite
    y = nonzero_merge(bits, values, x.numel(), out=out, backend=backend)
    assert y is out
    assert torch.equal(_ints(out), _ints(x.contiguous()))
    assert torch.equal(_ints(nonzero_merge(bits, values.clone(), x.numel(), backend=backend)),
                       _ints(x.contiguous()))  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_lib)])
@pytest.mark.parametrize("n", [9, 70, 100_003])
def test_merge_ignores_bits_past_numel(n: int, backend: str) -> None:
    """Set padding bits and spare bytes after the first ``numel`` bits are not read."""
    x = torch.randn(n).relu()
    bits, values = nonzero_split(x, backend=backend)
    padded = torch.cat([bits, torch.full((3,), 0xFF, dtype=torch.uint8)])
    padded[bits.numel() - 1] |= 0xFF << (n % 8) & 0xFF  # the last byte's unused bits
    for b in (padded, padded[: bits.numel()]):
        y = nonzero_merge(b, values, n, backend=backend)
        assert torch.equal(y, x) and nonzero_count(b, n) == values.numel()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool], ids=str)
def test_other_dtypes_take_the_reference(dtype: torch.dtype) -> None:
    x = torch.tensor([0, 1, 0, 1, 1, 0, 0, 0, 1, 0]).to(dtype)
    bits, values = nonzero_split(x)
    assert bits.tolist() == [26, 1] and values.dtype == dtype and values.numel() == 4
    assert torch.equal(nonzero_merge(bits, values, x.numel()), x)
    if cpu_lib.cpu_library() is not None:
        with pytest.raises(RuntimeError, match="backend='cpu'"):
            nonzero_split(x, backend="cpu")


@needs_lib
def test_auto_routes_cpu_tensors_to_the_compiled_path(monkeypatch) -> None:
    calls: list[str] = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(nonzero, "nonzero_split_cpu", spy(nonzero_split_cpu))
    monkeypatch.setattr(nonzero, "nonzero_merge_cpu", spy(nonzero_merge_cpu))
    x = torch.randn(300).relu()
    bits, values = nonzero_split(x)
    y = nonzero_merge(bits, values, x.numel())
    assert calls == ["nonzero_split_cpu", "nonzero_merge_cpu"]
    assert torch.equal(y, x)
    calls.clear()
    _same_split(nonzero_split(x, backend="torch"), nonzero_split_ref(x))
    assert torch.equal(nonzero_merge(bits, values, x.numel(), backend="torch"), x)
    _same_split(nonzero_split(x, backend="triton"), nonzero_split_ref(x))  # no Triton kernel
    assert calls == []
    monkeypatch.setattr("lightning_acgc.kernels.common.dispatch.cpu_library", lambda: None)
    _same_split(nonzero_split(x), nonzero_split_ref(x))  # no library: the reference
    assert calls == []


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_lib)])
def test_merge_rejects_bad_arguments(backend: str) -> None:
    x = torch.randn(20).relu()
    x[0] = 1.0
    bits, values = nonzero_split(x, backend=backend)
    with pytest.raises(ValueError, match="set bits"):
        nonzero_merge(bits, values[1:], 20, backend=backend)
    with pytest.raises(ValueError, match="set bits"):
        nonzero_merge(bits, torch.cat([values, values[:1]]), 20, backend=backend)
    with pytest.raises(ValueError, match="numel=25"):
        nonzero_merge(bits, values, 25, backend=backend)
    with pytest.raises(TypeError, match="uint8"):
        nonzero_merge(bits.to(torch.int32), values, 20, backend=backend)
    with pytest.raises(ValueError, match="1-D"):
        nonzero_merge(bits, values[:, None], 20, backend=backend)
    with pytest.raises(TypeError, match="out has dtype"):
        nonzero_merge(bits, values, 20, out=torch.empty(20, dtype=torch.float16), backend=backend)
    with pytest.raises(ValueError, match="contiguous tensor of numel=20"):
        nonzero_merge(bits, values, 20, out=torch.empty(21), backend=backend)
    with pytest.raises(ValueError, match="contiguous tensor of numel=20"):
        nonzero_merge(bits, values, 20, out=torch.empty(40)[::2], backend=backend)
    with pytest.raises(ValueError, match="backend='gpu' is not allowed"):
        nonzero_split(x, backend="gpu")


def test_count() -> None:
    bits = torch.tensor([0xFF, 0xFF, 0x0F], dtype=torch.uint8)
    assert [nonzero_count(bits, n) for n in (0, 3, 8, 9, 16, 20, 24)] == [0, 3, 8, 9, 16, 20, 20]
    x = torch.randn(1003).relu()
    assert nonzero_count(nonzero_split_ref(x)[0], 1003) == int((x != 0).sum())
    with pytest.raises(ValueError, match="numel=25"):
        nonzero_count(bits, 25)
    with pytest.raises(TypeError, match="uint8"):
        nonzero_count(bits.int(), 8)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 70), min_size=0, max_size=3),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_round_trip_property(dtype: torch.dtype, shape: list[int], density, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    x[torch.rand(shape, generator=g) >= density] = 0.0
    for backend in ("torch", "auto"):
        bits, values = nonzero_split(x, backend=backend)
        assert bits.numel() == -(-x.numel() // 8) and values.numel() == int((x != 0).sum())
        y = nonzero_merge(bits, values, x.numel(), backend=backend)
        assert torch.equal(_ints(y), _ints(x.contiguous()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_tensors_take_the_reference(dtype: torch.dtype) -> None:
    x = _specials(dtype, 70001)
    bits, values = nonzero_split(x.cuda())
    assert bits.is_cuda and values.is_cuda
    _same_split((bits.cpu(), values.cpu()), nonzero_split_ref(x))
    assert nonzero_count(bits, x.numel()) == values.numel()
    y = nonzero_merge(bits, values, x.numel())
    assert y.is_cuda and torch.equal(_ints(y.cpu()), _ints(x))
