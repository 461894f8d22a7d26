"""The compiled CPU kernels against the pure-torch references: bit-identical payloads for
the same seed, identical decodes, and the fallback when no compiler is there."""

from __future__ import annotations

import pytest
import torch

from lightning_acgc.kernels.common import cpu_lib
from lightning_acgc.kernels.common.dispatch import route
from lightning_acgc.kernels.division import division_decode_ref, division_encode_ref
from lightning_acgc.kernels.division.cpu import division_decode_cpu, division_encode_cpu
from lightning_acgc.kernels.mask.cpu import (
    mask_pack_cpu,
    mask_select_cpu,
    mask_two_cpu,
    mask_unpack_cpu,
)
from lightning_acgc.kernels.mask.reference import (
    mask_pack_ref,
    mask_select_ref,
    mask_two_ref,
    mask_unpack_ref,
)
from lightning_acgc.kernels.quant.cpu import quant_decode_cpu, quant_encode_cpu
from lightning_acgc.kernels.quant.reference import (
    hash_key,
    hash_uniform,
    quant_decode_ref,
    quant_encode_ref,
)
from tests._noise_spec import element_noise

pytestmark = pytest.mark.skipif(cpu_lib.cpu_library() is None, reason="no C compiler here")


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(523, 181, generator=g)
    mixed = x.clone()
    mixed[:300] = mixed[:300].relu()  # zero-kept groups next to signed ones
    mixed[300:310] = 0.0  # all-zero groups
    mixed[310:320] = 2.5  # constant groups
    return {
        "relu": x.relu()[:, :177],  # non-contiguous, odd tail
        "mixed": mixed,
        "tiny": torch.tensor([3.0]),
        "denormal": torch.tensor([1e-45, 0.0, 3e-44, 1e-40] * 5),
        "huge": torch.tensor([-3e38, 3e38, 1.0, 0.0] * 4),
        "nonfinite": torch.tensor([1.0, float("nan"), -2.0, float("inf"), 0.5] * 7),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k  # NaN-safe


@pytest.mark.parametrize("meta", ["fp32", "bf16"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("name", list(_inputs()))
def test_quant_cpu_bit_identical_to_reference(name: str, bits: int, meta: str) -> None:
    x = _inputs()[name]
    for group_size in (64, 256, 1024):
        ref = quant_encode_ref(x, bits, group_size, seed=11, meta=meta)
        fast = quant_encode_cpu(x, bits, group_size, seed=11, meta=meta)
        _same(fast, ref)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            a = quant_decode_cpu(ref, bits, group_size, x.numel(), dtype)
            b = quant_decode_ref(ref, bits, group_size, x.numel(), dtype)
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quant_cpu_half_inputs(dtype: torch.dtype) -> None:
    x = torch.randn(5000).relu().to(dtype)
    _same(quant_encode_cpu(x, 2, 256, 3), quant_encode_ref(x, 2, 256, 3))


def test_quant_cpu_other_seed_other_codes() -> None:
    x = torch.randn(4096)
    a, b = quant_encode_cpu(x, 2, 256, 1), quant_encode_cpu(x, 2, 256, 2)
    assert not torch.equal(a["codes"], b["codes"])


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 4096, 100003])
def test_mask_cpu_bit_identical(numel: int) -> None:
    m = torch.rand(numel) < 0.3
    packed = mask_pack_cpu(m)
    assert torch.equal(packed, mask_pack_ref(m))
    assert torch.equal(mask_unpack_cpu(packed, numel), mask_unpack_ref(packed, numel))
    assert torch.equal(mask_pack_cpu(m[::2]), mask_pack_ref(m[::2]))  # non-contiguous


def _two_valued(numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(numel)
    return (torch.rand(numel, generator=g) < 0.9).float() / 0.9  # a dropout's mask


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 4096, 100003])
def test_mask_two_cpu_bit_identical(numel: int) -> None:
    m = _two_valued(numel)
    lo, hi = (float(v) for v in torch.aminmax(m))
    for view in (m, m[::2], m.reshape(-1, 1).expand(-1, 3).t()):  # and non-contiguous
        bits, other = mask_two_cpu(view, lo, hi)
        ref_bits, ref_other = mask_two_ref(view, lo, hi)
        assert torch.equal(bits, ref_bits) and other == ref_other == 0
        n = view.numel()
        assert torch.equal(mask_select_cpu(bits, n, lo, hi), mask_select_ref(bits, n, lo, hi))
        assert torch.equal(mask_select_cpu(bits, n, lo, hi), view.reshape(-1))


def test_mask_two_cpu_counts_other_values() -> None:
    m = _two_valued(1003)
    lo, hi = (float(v) for v in torch.aminmax(m))
    m[5], m[17], m[1000] = float("nan"), 0.5, float("inf")  # the last in the scalar tail
    bits, other = mask_two_cpu(m, lo, hi)
    assert other == mask_two_ref(m, lo, hi)[1] == 3
    assert torch.equal(bits, mask_two_ref(m, lo, hi)[0])
    zeros = torch.tensor([0.0, -0.0, 1.0] * 5)  # -0.0 == 0.0, as torch compares
    assert mask_two_cpu(zeros, -0.0, 1.0)[1] == 0


@pytest.mark.parametrize("shape", [(2, 3, 13, 13), (4, 37, 50), (1000,)])
def test_division_cpu_bit_identical(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape).relu()
    args = (4, 2, 64, torch.bfloat16, 5)
    ref = division_encode_ref(x, *args)
    _same(division_encode_cpu(x, *args), ref)
    a = division_decode_cpu(ref, shape, x.dtype, 4, 2, 64)
    assert torch.equal(a, division_decode_ref(ref, shape, x.dtype, 4, 2, 64))


def test_no_compiler_falls_back_with_one_line(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("LIGHTNING_ACGC_CACHE", str(tmp_path / "cache"))
    assert cpu_lib.cpu_library.__wrapped__() is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("lightning_acgc: building the CPU kernels failed")
    assert "pure-torch reference" in lines[-1]


def test_build_into_fresh_cache(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("LIGHTNING_ACGC_CACHE", str(tmp_path))
    lib = cpu_lib.cpu_library.__wrapped__()
    assert lib is not None and hasattr(lib, "acgc_quant_encode")
    assert "compiling the CPU codec kernels (once)" in capsys.readouterr().err
    assert len(list(tmp_path.glob("fastcpu-*.so"))) == 1


def test_library_key_covers_every_source_and_the_header(monkeypatch, tmp_path) -> None:
    """Every C file of csrc/ is built, and an edit of the shared header alone builds a
    new library (a stale one would keep the old helpers)."""
    assert {p.name for p in cpu_lib._SOURCES} == {p.name for p in cpu_lib._CSRC.glob("*.c")}
    assert len(cpu_lib._SOURCES) >= 6
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for p in cpu_lib._CSRC.iterdir():
        (csrc / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(cpu_lib, "_CSRC", csrc)
    before = cpu_lib._source_bytes()
    header = csrc / "fastcpu.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert cpu_lib._source_bytes() != before


def test_route_uses_reference_without_library(monkeypatch) -> None:
    x = torch.ones(3)
    ref, fast = (lambda: "ref"), (lambda: "cpu")
    assert route(x, "auto", ref, "m:f", fast) is fast
    assert route(x, "torch", ref, "m:f", fast) is ref
    assert route(x, "auto", ref, None, fast) is fast  # a family without Triton (intpack)
    assert route(x, "triton", ref, None, fast) is ref
    with pytest.raises(ValueError, match="backend='gpu' is not allowed"):
        route(x, "gpu", ref, None, fast)
    monkeypatch.setattr("lightning_acgc.kernels.common.dispatch.cpu_library", lambda: None)
    assert route(x, "auto", ref, "m:f", fast) is ref
    with pytest.raises(RuntimeError, match="backend='cpu'"):
        route(x, "cpu", ref, "m:f", fast)
    with pytest.raises(ValueError, match="backend='gpu' is not allowed"):
        route(x, "gpu", ref, "m:f", fast)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.is_floating_point() else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(_inputs()))
@pytest.mark.parametrize("block", [1, 3, 8])
def test_division_cpu_fused_steps_bit_identical(name: str, dtype: torch.dtype, block: int) -> None:
    """The compiled pooling, zero pattern and decode finish give the reference's bits
    (signed, post-ReLU, constant, denormal, huge and NaN/inf inputs; partial tiles)."""
    x = _inputs()[name]
    x = x if dtype == torch.float32 else x.clamp(-6e4, 6e4).to(dtype)
    for t in (x, x.reshape(-1), x.reshape(1, 1, *x.shape) if x.ndim == 2 else x):
        args = (block, 2, 64, torch.bfloat16, 3)
        ref = division_encode_ref(t, *args)
        got = division_encode_cpu(t, *args)
        assert ref.keys() == got.keys()
        for k in ref:
            assert torch.equal(_bits(ref[k]), _bits(got[k])), k
        a = division_decode_cpu(ref, t.shape, dtype, block, 2, 64)
        b = division_decode_ref(ref, t.shape, dtype, block, 2, 64)
        assert torch.equal(_bits(a), _bits(b))


def _division_shapes() -> dict[str, torch.Tensor]:
    """Inputs the fused division kernels take: 1-D to 4-D, partial tiles, a transposed
    and a channels_last view, signed and post-ReLU values."""
    g = torch.Generator().manual_seed(5)
    nchw = torch.randn(3, 5, 13, 22, generator=g)
    return {
        "1d": torch.randn(5003, generator=g).relu(),
        "2d_transposed": torch.randn(61, 37, generator=g).t(),
        "3d": torch.randn(4, 29, 33, generator=g),
        "4d_relu": nchw.relu(),
        "4d_channels_last": nchw.to(memory_format=torch.channels_last),
        "4d_one_plane": torch.randn(1, 1, 7, 9, generator=g).relu() + 1.0,  # no zeros
        # rows of whole tiles (the averages in bands, the upsample tile by tile): tile rows
        # within planes (h a multiple of the block) or not, one row per tile row (2-D), and
        # a tensor of several threads, bands and blocks of groups
        "4d_whole_tiles": torch.randn(2, 3, 16, 24, generator=g).relu(),
        "4d_short_tile_rows": torch.randn(2, 3, 13, 16, generator=g),
        "2d_whole_tiles": torch.randn(40, 72, generator=g),
        # without pooled rows, blocks read the averages in place, all but the last
        "1d_whole_tiles": torch.randn(3 * 4096 + 24, generator=g).relu(),
        "2d_rows_across_blocks": torch.randn(130, 64, generator=g),
        "4d_large": torch.randn(4, 16, 40, 48, generator=g).relu(),
        # rows of a few tiles and a short one (ImageNet ResNets' 28x28 and 7x7 maps), and
        # rows of more than 8 tiles (the averages 8 tiles at a time) and of more than 16
        # (the upsample past one register of tiles)
        "4d_resnet_maps": torch.randn(2, 4, 28, 28, generator=g).relu(),
        "4d_small_maps": torch.randn(3, 5, 7, 7, generator=g),
        "4d_wide_short_tile": torch.randn(2, 2, 11, 75, generator=g).relu(),
        "4d_wider_than_16_tiles": torch.randn(1, 2, 9, 133, generator=g),
    }


@pytest.mark.parametrize("low_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(_division_shapes()))
@pytest.mark.parametrize(("block", "bits", "group_size"), [(8, 2, 256), (3, 1, 8), (4, 5, 4096)])
def test_division_fused_kernels_bit_identical(
    name: str, low_dtype: torch.dtype, block: int, bits: int, group_size: int
) -> None:
    """The fused encoder and decoder run (do not decline) on ordinary tensors and give the
    reference's payload and decode, bit for bit, for every output dtype."""
    from lightning_acgc.kernels.division.cpu import _decode_fused, _encode_fused

    x = _division_shapes()[name]
    ref = division_encode_ref(x, block, bits, group_size, low_dtype, 7)
    got = _encode_fused(x, block, bits, group_size, low_dtype, 7)
    assert got is not None
    _same(got, ref)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = _decode_fused(ref, x.shape, dtype, block, bits, group_size)
        assert a is not None
        b = division_decode_ref(ref, x.shape, dtype, block, bits, group_size)
        assert torch.equal(_bits(a), _bits(b)), dtype


def test_division_fused_decode_declines_a_residual_that_needs_float64() -> None:
    """A group whose lo + levels * step overflows float32 makes the reference decode the
    residual in float64: the fused decoder declines (C checks before writing) and the
    public decode gives the reference's bits."""
    from lightning_acgc.kernels.division.cpu import _decode_fused

    x = torch.randn(4, 64)
    payload = dict(division_encode_ref(x, 8, 2, 64, torch.float32, 7))
    payload["lo"], payload["scale"] = payload["lo"].clone(), payload["scale"].clone()
    payload["lo"][0], payload["scale"][0] = 3e38, 1e38  # 3e38 + 3 * 1e38 overflows
    assert _decode_fused(payload, x.shape, torch.float32, 8, 2, 64) is None
    got = division_decode_cpu(payload, x.shape, torch.float32, 8, 2, 64)
    want = division_decode_ref(payload, x.shape, torch.float32, 8, 2, 64)
    assert torch.equal(_bits(got), _bits(want))


def test_division_fused_kernels_decline_what_the_reference_handles() -> None:
    """NaN/inf, subnormal averages, float16 averages, groups over 4096 and 5-D tensors go to
    the unfused path, which still gives the reference's bits."""
    from lightning_acgc.kernels.division.cpu import _encode_fused

    cases = [
        (torch.tensor([1.0, float("nan"), 2.0, 0.0] * 8), torch.bfloat16, 64),
        (torch.tensor([1e-40, 0.0, 3e-39, 1e-41] * 8), torch.float32, 64),
        (torch.randn(64), torch.float16, 64),
        (torch.randn(10000), torch.bfloat16, 8192),
        (torch.randn(2, 2, 4, 4, 4), torch.bfloat16, 64),
    ]
    for x, low_dtype, group_size in cases:
        assert _encode_fused(x, 4, 2, group_size, low_dtype, 1) is None
        ref = division_encode_ref(x, 4, 2, group_size, low_dtype, 1)
        _same(division_encode_cpu(x, 4, 2, group_size, low_dtype, 1), ref)
        a = division_decode_cpu(ref, x.shape, x.dtype, 4, 2, group_size)
        b = division_decode_ref(ref, x.shape, x.dtype, 4, 2, group_size)
        assert torch.equal(_bits(a), _bits(b))


def _int_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "pool_indices": torch.randint(0, 12544, (3, 5000), generator=g),  # several blocks
        "int64_extremes": torch.tensor([-(2**63), 2**63 - 1, 0, -1, 5] * 7),  # width 64
        "constant": torch.full((4099,), -17),  # width 0
        "int32_signed": torch.randint(-(2**31), 2**31 - 1, (777,), generator=g, dtype=torch.int32),
        "uint8": torch.randint(0, 256, (100,), generator=g, dtype=torch.uint8),
        "one": torch.tensor([42]),
        "transposed": torch.arange(60000).view(60, 1000).t(),
        "wide": torch.randint(0, 2**62, (9000,), generator=g),
    }


@pytest.mark.parametrize("group_size", [8, 256, 1000])
@pytest.mark.parametrize("name", sorted(_int_inputs()))
def test_intpack_cpu_bit_identical(name: str, group_size: int) -> None:
    """The compiled intpack gives the reference's payload byte for byte, and decodes any
    payload to the exact tensor (groups that straddle the kernel's 4096-value blocks)."""
    from lightning_acgc.kernels.intpack import intpack_decode_ref, intpack_encode_ref
    from lightning_acgc.kernels.intpack.cpu import intpack_decode_cpu, intpack_encode_cpu

    x = _int_inputs()[name]
    ref = intpack_encode_ref(x, group_size)
    got = intpack_encode_cpu(x, group_size)
    assert ref.keys() == got.keys()
    for k in ref:
        assert ref[k].dtype == got[k].dtype and torch.equal(ref[k], got[k]), k
    out = intpack_decode_cpu(ref, group_size, x.numel(), x.dtype)
    assert out.dtype == x.dtype and torch.equal(out, x.reshape(-1))
    assert torch.equal(out, intpack_decode_ref(ref, group_size, x.numel(), x.dtype))


def test_intpack_cpu_rejects_a_payload_of_another_size() -> None:
    from lightning_acgc.kernels.intpack.cpu import intpack_decode_cpu, intpack_encode_cpu

    payload = intpack_encode_cpu(torch.arange(100), 16)
    with pytest.raises(ValueError, match="numel=200 does not match"):
        intpack_decode_cpu(payload, 16, 200, torch.int64)


@pytest.mark.parametrize("base", [0, 2**33 - 8, 2**40 + 2**33 - 2])
def test_compiled_noise_follows_the_pair_hash_past_32_bit_indices(base: int) -> None:
    """The C encode's noise of elements ``base..base+15``: pair p = i >> 1 hashes
    ``(p mod 2**32) ^ lowbias32((p >> 32) ^ key)``, element 2p takes the low half. Pairs
    that cross 2**32 take the C path's 64-bit branch (no tensor reaches it)."""
    key = hash_key(77)
    out = torch.empty(16)
    cpu_lib.cpu_library().acgc_quant_noise(base, 16, key, out.data_ptr())
    assert out.tolist() == [element_noise(i, key) for i in range(base, base + 16)]
    if base == 0:
        assert torch.equal(out, hash_uniform(16, 77))
