"""Properties of the ``bounded`` codec and its pure-torch kernels (CPU path)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_acgc.codecs.bounded  # noqa: F401  (registers "bounded")
from lightning_acgc.codecs import build_codec
from lightning_acgc.codecs.bounded import BoundedCodec, BoundedConfig
from lightning_acgc.kernels import bounded as bk
from lightning_acgc.kernels.bounded import plan as bplan
from lightning_acgc.kernels.bounded import reference as bref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = [
    "normal",
    "uniform",
    "constant",
    "huge",
    "denormal",
    "relu",
    "dropout",
    "smooth",
    "tiny_pos",
    "near_max",
    "special",
]
SHAPES = [(), (0,), (1,), (7,), (1823,), (3, 0, 5), (13, 17), (41, 9), (2, 3, 37)]


def _make(kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    low_precision = dtype != torch.float32
    if kind == "uniform":
        x = torch.rand(shape, generator=g, dtype=torch.float64) * 7 - 2
    elif kind == "constant":
        x = torch.full(shape, float(torch.randn((), generator=g)) * 100, dtype=torch.float64)
    elif kind == "huge":
        x = x * (6e4 / 5 if low_precision else 1e30)
    elif kind == "denormal":
        x = x * (1e-6 if dtype == torch.float16 else 1e-40)
    elif kind == "relu":
        x = x.clamp(min=0)
    elif kind == "dropout":
        x = x * (torch.rand(shape, generator=g) > 0.4)
    elif kind == "smooth":
        t = torch.linspace(0, 9, max(1, x.numel()), dtype=torch.float64)[: x.numel()]
        x = (torch.sin(t) + 0.3 * torch.cos(5 * t)).reshape(shape)
    elif kind == "tiny_pos":  # positives far below the bound next to exact zeros
        x = torch.rand(shape, generator=g, dtype=torch.float64) * 1e-4
        x = x * (torch.rand(shape, generator=g) > 0.5)
    elif kind == "near_max":
        top = torch.finfo(dtype).max
        x = top * (1 - torch.rand(shape, generator=g, dtype=torch.float64) * 1e-3)
        x = x * torch.sign(torch.randn(shape, generator=g, dtype=torch.float64))
    x = x.to(dtype)
    if kind == "special" and x.numel():
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (4,), generator=g)
        flat[idx] = torch.tensor([math.nan, math.inf, -math.inf, math.nan], dtype=dtype)
    return x


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Shapes (0-d, empty, odd tails), dtypes, value kinds, non-contiguous views."""
    if draw(st.booleans()):
        shape = draw(st.sampled_from(SHAPES))
    else:
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 24), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    x = _make(draw(st.sampled_from(KINDS)), shape, dtype, draw(st.integers(0, 2**31)))
    view = draw(st.sampled_from(["plain", "transpose", "slice", "expand"]))
    if view == "transpose" and x.dim() >= 2:
        x = x.transpose(0, -1)
    elif view == "slice" and x.dim() >= 1:
        x = x[..., ::2]
    elif view == "expand" and x.dim() >= 1:
        x = x.unsqueeze(0).expand(3, *x.shape)
    return x


def _roundtrip(x: torch.Tensor, **options):
    codec = BoundedCodec(BoundedConfig(**options))
    packed = codec.encode(x, 0)
    return packed, codec.decode(packed)


def _check(x: torch.Tensor, y: torch.Tensor, eb: float, group_size: int) -> None:
    """The bound per element in float64, NaN/inf exact, zeros exact, and positives of
    groups with a non-negative finite minimum still positive."""
    assert y.shape == x.shape and y.dtype == x.dtype
    xf, yf = x.reshape(-1).double(), y.reshape(-1).double()
    assert torch.equal(torch.isnan(xf), torch.isnan(yf))
    inf = torch.isinf(xf)
    assert torch.equal(xf[inf], yf[inf])
    fin = torch.isfinite(xf)
    err = (xf[fin] - yf[fin]).abs()
    assert bool((err <= eb).all()), f"max error {err.max().item()} > bound {eb}"
    assert bool((yf[xf == 0] == 0).all()), "an exact zero did not decode to 0"
    n = xf.numel()
    if n == 0:
        return
    pad = -n % group_size
    groups = torch.cat([xf, xf[-1:].expand(pad)]).view(-1, group_size)
    gmin = torch.where(torch.isfinite(groups), groups, math.inf).amin(dim=1)
    nonneg = (gmin >= 0).repeat_interleave(group_size)[:n]
    pos = nonneg & (xf > 0) & fin
    assert bool((yf[pos] > 0).all()), "a positive of a non-negative group lost its sign"


@settings(max_examples=150, deadline=None)
@given(
    x=tensors(),
    eb=st.sampled_from([1e-6, 1e-3, 1e-2, 0.1, 10.0]),
    group=st.sampled_from([8, 64, 256]),
)
def test_bound_holds_for_every_element(x: torch.Tensor, eb: float, group: int) -> None:
    _, y = _roundtrip(x, error_bound=eb, group_size=group)
    _check(x, y, eb, group)


@settings(max_examples=60, deadline=None)
@given(x=tensors(), eb=st.sampled_from([1e-4, 1e-2, 0.25]), group=st.sampled_from([8, 256]))
def test_relative_bound_is_a_fraction_of_the_finite_range(
    x: torch.Tensor, eb: float, group: int
) -> None:
    packed, y = _roundtrip(x, error_bound=eb, relative=True, group_size=group)
    fin = x.reshape(-1)[torch.isfinite(x.reshape(-1))].double()
    bound = eb * (fin.max() - fin.min()).item() if fin.numel() else 0.0
    if x.numel():
        assert packed.meta == {"error_bound": eb, "relative": True, "group_size": group}
        assert packed.payload["bound"].item() == pytest.approx(bound, rel=1e-12)
    _check(x, y, bound, group)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_exact_and_tiny_positives_stay_positive(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    eb = 0.05
    small = torch.rand(4096, generator=g) * eb / 10  # all within the bound of 0
    big = torch.rand(4096, generator=g) * 3
    x = torch.cat([small, big]) * (torch.rand(8192, generator=g) > 0.5)
    x = x.to(dtype)
    _, y = _roundtrip(x, error_bound=eb)
    assert torch.equal(x == 0, y == 0)
    assert bool((y >= 0).all()) and not bool(torch.signbit(y[x == 0]).any())
    _check(x, y, eb, 256)


def test_mixed_sign_groups_keep_exact_zeros() -> None:
    x = torch.randn(64, 256) * (torch.rand(64, 256) > 0.3)  # dropout output
    packed, y = _roundtrip(x, error_bound=0.05)
    assert bool((y[x == 0] == 0).all())
    assert bool(torch.signbit(packed.payload["step"]).all())  # every group zero-kept
    _check(x, y, 0.05, 256)


def _ratio(x: torch.Tensor, packed) -> float:
    return x.numel() * x.element_size() / packed.nbytes


def test_smooth_data_compresses_well() -> None:
    t = torch.linspace(0, 40, 256 * 1024)
    x = torch.sin(t) + 0.5 * torch.cos(3.3 * t) + 0.01 * torch.sin(500 * t)
    packed, y = _roundtrip(x, error_bound=0.01, relative=True)
    assert _ratio(x, packed) >= 6
    bound = 0.01 * (x.max() - x.min()).item()
    _check(x, y, bound, 256)


def test_narrow_groups_take_few_bits() -> None:
    x = 100 + torch.rand(512, 256) * 0.1  # range 0.1 in every group, eb 0.01: 3 bits
    packed, _ = _roundtrip(x, error_bound=0.01)
    assert packed.payload["width"].max().item() <= 3
    assert _ratio(x, packed) >= 8


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_groups_cost_almost_nothing(relative: bool, dtype: torch.dtype) -> None:
    x = torch.full((64, 256), -3.75, dtype=dtype)
    packed, y = _roundtrip(x, error_bound=1e-3, relative=relative)
    assert torch.equal(y, x)
    assert packed.payload["codes"].numel() == 0 and packed.payload["raw"].numel() == 0
    assert packed.nbytes * 8 / x.numel() <= 0.3  # width, lo and step per 256 values
    mixed = torch.cat([torch.zeros(32, 256), torch.randn(32, 256)]).to(dtype)
    packed, y = _roundtrip(mixed, error_bound=0.1)
    assert bool((packed.payload["width"][:32] == 0).all())
    assert torch.equal(y[:32], mixed[:32])


def test_same_input_gives_identical_bytes() -> None:
    x = _make("special", (37, 129), torch.float32, 3).transpose(0, 1)
    a, _ = _roundtrip(x, error_bound=1e-3)
    b, _ = _roundtrip(x, error_bound=1e-3)
    assert a.payload.keys() == b.payload.keys() and a.meta == b.meta
    for k in a.payload:
        pa, pb = a.payload[k].reshape(-1), b.payload[k].reshape(-1)
        assert pa.dtype == pb.dtype and torch.equal(pa.view(torch.uint8), pb.view(torch.uint8))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("error_bound", 0),
        ("error_bound", -1),
        ("error_bound", math.nan),
        ("error_bound", math.inf),
        ("error_bound", "0.1"),
        ("group_size", 0),
        ("group_size", 12),
        ("relative", "yes"),
    ],
)
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        BoundedConfig(**{field: value})


def test_built_through_the_registry() -> None:
    codec = build_codec("bounded", {"error_bound": 0.5, "group_size": 64})
    assert isinstance(codec, BoundedCodec) and codec.config.error_bound == 0.5
    with pytest.raises(ValueError, match="bits"):
        build_codec("bounded", {"bits": 2})


@pytest.mark.parametrize(
    "x",
    [
        torch.arange(10),
        torch.ones(4, dtype=torch.bool),
        torch.randn(8, dtype=torch.float64),
        torch.randn(8, dtype=torch.complex64),
    ],
    ids=["int64", "bool", "float64", "complex64"],
)
def test_declines_what_it_cannot_take(x: torch.Tensor) -> None:
    assert BoundedCodec(BoundedConfig()).encode(x, 0) is None


def test_empty_tensor_kept_raw() -> None:
    codec = BoundedCodec(BoundedConfig())
    x = torch.empty(3, 0, 4, dtype=torch.bfloat16)
    packed = codec.encode(x, 0)
    assert packed.codec == "identity"
    y = codec.decode(packed)
    assert y.shape == x.shape and y.dtype == x.dtype


# ---- kernel level: the format -------------------------------------------------------


@pytest.mark.parametrize("b", range(1, 17))
def test_bit_stream_layout(b: int) -> None:
    """Code i of a block sits at bits [b*i, b*i+b) of a little-endian byte stream."""
    g = torch.Generator().manual_seed(b)
    codes = torch.randint(0, 2**b, (5, 8), generator=g, dtype=torch.int32)
    data = bref._pack_block(codes.t().contiguous(), b)
    assert data.shape == (5, b) and data.dtype == torch.uint8
    for blk in range(5):
        stream = sum(int(c) << (b * i) for i, c in enumerate(codes[blk]))
        assert bytes(data[blk].tolist()) == stream.to_bytes(b, "little")
    assert torch.equal(bref._unpack_block(data, b).t(), codes)


def test_payload_layout() -> None:
    x = torch.cat([torch.zeros(256), torch.randn(256), torch.randn(256) * 1e30, torch.ones(100)])
    p = bk.bounded_encode_ref(x, 1e-3, 256)
    width = p["width"].tolist()
    assert width[0] == 0 and 1 <= width[1] <= 16 and width[2] == bk.RAW_WIDTH and width[3] == 0
    assert p["codes"].numel() == 256 // 8 * width[1]
    assert torch.equal(p["raw"], x[512:768])
    assert p["lo"].dtype == p["step"].dtype == torch.float32
    assert p["step"][0] == 0 and p["step"][3] == 0 and p["lo"][3] == 1
    y = bk.bounded_decode(p, 256, x.numel(), x.dtype, backend="torch")
    assert torch.equal(y[512:768], x[512:768]) and torch.equal(y[768:], x[768:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_output_needs_few_exceptions(dtype: torch.dtype) -> None:
    """The step accounts for the dtype's spacing, so the cast rarely breaks the bound."""
    x = (torch.randn(64, 1024) * 3).to(dtype)
    for eb in (2e-3, 1e-2, 0.1):
        packed, y = _roundtrip(x, error_bound=eb)
        assert packed.payload["exc_idx"].numel() <= x.numel() // 1000
        _check(x, y, eb, 256)


@pytest.mark.parametrize("dtype", DTYPES)
def test_violators_are_kept_exactly(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """With too large steps forced, the check still keeps the bound through exceptions."""
    monkeypatch.setattr(bplan, "_STEP_SLACK", 1.6)
    x = (torch.randn(40, 300) * 2).to(dtype)
    packed, y = _roundtrip(x, error_bound=0.05)
    assert packed.payload["exc_idx"].numel() > 0
    idx = packed.payload["exc_idx"]
    assert torch.equal(idx, idx.sort().values)
    _check(x, y, 0.05, 256)


def test_eb_below_dtype_spacing_goes_raw() -> None:
    x = torch.randn(4, 256).to(torch.bfloat16) + 8  # spacing 1/16 near 8
    packed, y = _roundtrip(x, error_bound=1e-3)
    assert bool((packed.payload["width"] == bk.RAW_WIDTH).all())
    assert torch.equal(y, x)


def test_kernel_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dtype"):
        bk.bounded_encode_ref(torch.randn(8, dtype=torch.float64), 0.1, 8)
    with pytest.raises(ValueError, match="group_size"):
        bk.bounded_encode_ref(torch.randn(8), 0.1, 12)
    with pytest.raises(ValueError, match="error_bound"):
        bk.bounded_encode_ref(torch.randn(8), 0.0, 8)
    with pytest.raises(ValueError, match="empty"):
        bk.bounded_encode_ref(torch.randn(0), 0.1, 8)
