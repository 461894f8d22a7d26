"""The ``split`` codec: two adjacent quant widths in one tensor (a fractional width)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_acgc.codecs import build_codec
from lightning_acgc.codecs.quant import QuantCodec, QuantWidthConfig
from lightning_acgc.codecs.split import SplitCodec, SplitConfig, split_point
from lightning_acgc.kernels import quant as qk
from tests.test_codec_quant import checked_round_trip, output_rounding, tensors


def _steps(packed, numel: int, group: int) -> torch.Tensor:
    """Each element's quantization step, from the two parts' metadata."""
    out = []
    k = packed.meta["split"]
    for name, n in (("lo", k), ("hi", numel - k)):
        if name in packed.meta:
            scale = packed.payload[f"{name}.scale"].abs().double()
            out.append(scale.repeat_interleave(group)[:n])
    return torch.cat(out)


@settings(max_examples=60, deadline=None)
@given(
    x=tensors(),
    bits=st.integers(2, 8),
    share=st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]),
    group=st.sampled_from([8, 64, 256]),
)
def test_split_within_its_parts_step_and_keeps_specials(
    x: torch.Tensor, bits: int, share: float, group: int
) -> None:
    codec = SplitCodec(SplitConfig(bits=bits, low_share=share, group_size=group))
    checked = checked_round_trip(codec, x, seed=3)
    if checked is None:
        return
    packed, y, finite = checked
    steps = _steps(packed, x.numel(), group)
    xd, yd = x.reshape(-1).double(), y.reshape(-1).double()
    ulp = output_rounding(xd, yd, x.dtype)
    f = finite.reshape(-1)
    assert bool(((xd - yd).abs()[f] <= steps[f] * (1 + 1e-5) + ulp[f]).all())


def test_split_parts_are_the_quant_encodings_of_their_halves() -> None:
    """Bit-exact against the reference built from two ``quant`` encodings."""
    x = torch.randn(7, 1000).relu()
    codec = SplitCodec(SplitConfig(bits=4, low_share=0.3, group_size=64))
    packed = codec.encode(x, seed=11)
    k = split_point(x.numel(), 0.3, 64)
    lo = QuantCodec(QuantWidthConfig(bits=3, group_size=64)).encode(x.reshape(-1)[:k], 11)
    assert k == packed.meta["split"] and k % 64 == 0 and 0 < k < x.numel()
    assert all(torch.equal(packed.payload[f"lo.{n}"], t) for n, t in lo.payload.items())
    y = codec.decode(packed)
    lo_y = QuantCodec(QuantWidthConfig(bits=3, group_size=64)).decode(lo)
    torch.testing.assert_close(y.reshape(-1)[:k], lo_y, atol=0, rtol=0)


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_split_bytes_and_error_lie_between_the_two_widths(share: float) -> None:
    x = torch.randn(64, 1024)
    lo = QuantCodec(QuantWidthConfig(bits=2)).encode(x, 0)
    hi = QuantCodec(QuantWidthConfig(bits=3)).encode(x, 0)
    packed = SplitCodec(SplitConfig(bits=3, low_share=share)).encode(x, 0)
    expected = share * lo.nbytes + (1 - share) * hi.nbytes
    assert abs(packed.nbytes - expected) <= 16, (packed.nbytes, expected)
    y = SplitCodec(SplitConfig(bits=3, low_share=share)).decode(packed)
    err = (y - x).pow(2).mean().item()
    lo_err = (QuantCodec(QuantWidthConfig(bits=2)).decode(lo) - x).pow(2).mean().item()
    hi_err = (QuantCodec(QuantWidthConfig(bits=3)).decode(hi) - x).pow(2).mean().item()
    assert err == pytest.approx(share * lo_err + (1 - share) * hi_err, rel=0.05)


def test_split_is_unbiased_over_seeds() -> None:
    x = torch.cat([torch.randn(2048), torch.randn(2048).relu()])
    codec = SplitCodec(SplitConfig(bits=2, low_share=0.5))
    mean = torch.stack([codec.decode(codec.encode(x, s)).double() for s in range(300)]).mean(0)
    step = (x.max() - x.min()).item()
    assert (mean - x.double()).mean().abs().item() < 0.01 * step


def test_split_passes_what_quant_cannot_take() -> None:
    codec = build_codec("split", {"bits": 3, "low_share": 0.5})
    assert codec.encode(torch.arange(10), 0) is None
    assert codec.encode(torch.randn(10, dtype=torch.float64), 0) is None
    empty = torch.empty(0, 3)
    assert codec.decode(codec.encode(empty, 0)).shape == (0, 3)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"bits": 1}, "bits"),
        ({"bits": 9}, "bits"),
        ({"low_share": 1.5}, "low_share"),
        ({"low_share": -0.1}, "low_share"),
        ({"low_share": True}, "low_share"),
        ({"group_size": 12}, "group_size"),
        ({"meta": "fp8"}, "meta"),
    ],
)
def test_split_bad_options(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SplitConfig(**options)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_split_decodes_both_parts_into_one_output(backend: str) -> None:
    """The parts decode into slices of one output (in place on the compiled CPU path):
    the same values as decoding each part on its own, on every backend."""
    x = torch.randn(5, 999).relu()
    x[2, 7] = float("nan")
    codec = SplitCodec(SplitConfig(bits=4, low_share=0.4, group_size=64))
    codec.backend = backend
    packed = codec.encode(x, seed=2)
    parts = []
    for name, n in (("lo", packed.meta["split"]), ("hi", x.numel() - packed.meta["split"])):
        payload = {k[3:]: t for k, t in packed.payload.items() if k.startswith(name + ".")}
        meta = packed.meta[name]
        parts.append(qk.quant_decode(payload, meta["bits"], meta["group_size"], n, x.dtype))
    expected = torch.cat(parts).view(x.shape)
    torch.testing.assert_close(codec.decode(packed), expected, rtol=0, atol=0, equal_nan=True)


def test_quant_decode_into_out_leaves_the_rest_and_checks_dtype() -> None:
    x = torch.randn(300)
    payload = qk.quant_encode(x, 3, 64, seed=1)
    for backend in ("auto", "torch"):
        out = torch.full((500,), 7.0)
        got = qk.quant_decode(payload, 3, 64, 300, torch.float32, backend=backend, out=out[100:400])
        assert got.data_ptr() == out[100:400].data_ptr()
        assert bool((out[:100] == 7).all()) and bool((out[400:] == 7).all())
        torch.testing.assert_close(got, qk.quant_decode(payload, 3, 64, 300, torch.float32))
    with pytest.raises(ValueError, match="dtype"):
        qk.quant_decode(payload, 3, 64, 300, torch.float32, out=torch.empty(300).half())
