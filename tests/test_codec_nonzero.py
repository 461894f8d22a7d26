"""The ``nonzero`` codec: a mask of the non-zero values, those values as ``quant``/``split``;
and acgc's use of it for tensors of many zeros."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_acgc.codecs import build_codec
from lightning_acgc.codecs.nonzero import NonzeroCodec, NonzeroConfig
from lightning_acgc.codecs.quant import QuantCodec, QuantWidthConfig
from lightning_acgc.codecs.split import SplitCodec, SplitConfig
from lightning_acgc.engine import ActivationCompressor, EngineSettings, compressed_step
from lightning_acgc.kernels.nonzero import nonzero_split
from lightning_acgc.policies import acgc_nonzero as layout
from lightning_acgc.policies import build_policy
from lightning_acgc.policies.bit_allocation import LADDER, allocate_to_error
from tests.test_codec_quant import _check_special, checked_round_trip, output_rounding, tensors


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _steps(packed, group: int) -> torch.Tensor:
    """Each non-zero value's quantization step, in the order the mask lists them."""
    scale = packed.payload["values.scale"].abs().double()
    return scale.repeat_interleave(group)[: packed.meta["nnz"]]


@settings(max_examples=60, deadline=None)
@given(x=tensors(), bits=st.integers(1, 8), group=st.sampled_from([8, 64, 256]))
def test_within_one_step_zeros_exact_specials_kept(x: torch.Tensor, bits: int, group: int) -> None:
    codec = NonzeroCodec(NonzeroConfig(bits=bits, group_size=group))
    checked = checked_round_trip(codec, x, seed=5)
    if checked is None:
        return
    packed, y, finite = checked
    zero = _as_ints(x) == 0  # +0.0 only: its bits all clear
    assert bool((_as_ints(y)[zero] == 0).all())  # decoded as +0.0, bit for bit
    xd, yd = x.reshape(-1).double(), y.reshape(-1).double()
    f = finite.reshape(-1) & ~zero
    if packed.meta["nnz"]:
        err = (xd - yd).abs()[~zero]
        bound = _steps(packed, group) * (1 + 1e-5) + output_rounding(xd, yd, x.dtype)[~zero]
        assert bool((err <= bound)[f[~zero]].all())


def test_values_are_the_quant_encoding_of_the_non_zeros() -> None:
    """Bit-exact against the reference: ``quant`` of the packed non-zero values."""
    x = torch.randn(6, 999).relu()
    x[0, :5] = -0.0  # a value, not a zero: its bits are not all clear
    packed = NonzeroCodec(NonzeroConfig(bits=3, group_size=64)).encode(x, seed=9)
    values = x.reshape(-1)[_as_ints(x) != 0]
    ref = QuantCodec(QuantWidthConfig(bits=3, group_size=64)).encode(values, 9)
    assert packed.meta["nnz"] == values.numel()
    assert all(torch.equal(packed.payload[f"values.{k}"], t) for k, t in ref.payload.items())
    mask = packed.payload["mask"]
    assert mask.dtype == torch.uint8 and mask.numel() == math.ceil(x.numel() / 8)


def test_split_values_round_trip_at_their_mean_width() -> None:
    x = torch.randn(8, 1024).relu()
    codec = NonzeroCodec(NonzeroConfig(bits=4, low_share=0.5, group_size=256))
    packed = codec.encode(x, seed=1)
    values = x.reshape(-1)[x.reshape(-1) != 0]
    ref = SplitCodec(SplitConfig(bits=4, low_share=0.5)).encode(values, 1)
    assert all(torch.equal(packed.payload[f"values.{k}"], t) for k, t in ref.payload.items())
    y = codec.decode(packed)
    assert torch.equal(y == 0, x == 0)
    assert float((y - x).abs().max()) <= float(x.max()) / 7 + 1e-6  # within a 3-bit step


def test_costs_a_mask_bit_and_the_width_for_the_non_zeros_only() -> None:
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)).relu()
    nnz = int((x != 0).sum())
    nz = NonzeroCodec(NonzeroConfig(bits=6, meta="bf16")).encode(x, seed=0)
    dense = QuantCodec(QuantWidthConfig(bits=6, meta="bf16")).encode(x, seed=0)
    groups = math.ceil(nnz / 256)  # codes fill whole groups
    assert nz.nbytes <= x.numel() / 8 + groups * (256 * 6 / 8 + 4)
    assert nz.nbytes < 0.75 * dense.nbytes


def test_one_bit_keeps_every_zero() -> None:
    """``quant`` at 1 bit cannot keep a ReLU's zeros; the mask does."""
    x = torch.rand(4096) * (torch.rand(4096) > 0.5)
    y = NonzeroCodec(NonzeroConfig(bits=1)).encode(x, seed=2)
    out = NonzeroCodec(NonzeroConfig(bits=1)).decode(y)
    assert torch.equal(out == 0, x == 0)
    dense = QuantCodec(QuantWidthConfig(bits=1)).encode(x, seed=2)
    assert not torch.equal(QuantCodec(QuantWidthConfig(bits=1)).decode(dense) == 0, x == 0)


@pytest.mark.parametrize(
    "x",
    [
        torch.zeros(1000),
        torch.ones(1000),
        torch.zeros(()),
        torch.tensor(3.5),
        torch.empty(0, 7),
        torch.randn(40, 30).relu().t(),  # non-contiguous
        torch.tensor([0.0, float("nan"), 0.0, float("inf"), -float("inf"), 1e-40, 0.0]),
    ],
    ids=["zeros", "ones", "0d_zero", "0d", "empty", "transposed", "specials"],
)
def test_adversarial_inputs_round_trip(x: torch.Tensor) -> None:
    codec = NonzeroCodec(NonzeroConfig(bits=2))
    y = codec.decode(codec.encode(x, seed=0))
    assert y.shape == x.shape and y.dtype == x.dtype
    _check_special(x, y)
    assert bool((y[x == 0] == 0).all())
    finite = torch.isfinite(x)
    spread = float(x[finite].max() - x[finite].min()) if finite.any() else 0.0
    err = (y - x)[finite].abs()
    assert float(err.max()) <= spread + 1e-6 if err.numel() else True


@pytest.mark.parametrize(
    "options, match",
    [
        ({"bits": 0}, "bits"),
        ({"bits": 9}, "bits"),
        ({"bits": 1, "low_share": 0.5}, "low_share"),
        ({"low_share": 1.5}, "low_share"),
        ({"meta": "fp8"}, "meta"),
        ({"group_size": 10}, "group_size"),
    ],
)
def test_bad_options_name_the_parameter(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_codec("nonzero", options)


def test_integer_and_float64_tensors_are_not_taken() -> None:
    codec = NonzeroCodec(NonzeroConfig())
    assert codec.encode(torch.arange(10), 0) is None
    assert codec.encode(torch.randn(10, dtype=torch.float64), 0) is None


def test_a_sparse_tensor_gets_the_cheaper_bits() -> None:
    """Same sensitivity and variance, one tensor a third non-zero: its bits cost a third,
    so the allocation spends them there."""
    errors = [{b: 2.0**-b for b in LADDER}] * 2
    dense = allocate_to_error([1000, 1000], errors, 0.08, [1, 1], [32, 32], 0.125)
    sparse = allocate_to_error(
        [1000, 1000], errors, 0.08, [1, 1], [32, 32], 0.125, densities=[1 / 3, 1.0]
    )
    assert dense[0] == dense[1]
    assert sparse[0] > sparse[1]


def test_rounding_table_is_the_nonzero_codecs_error() -> None:
    """The modelled variance of a ReLU output (mean over all its values, zeros exact)
    is what the ``nonzero`` codec measures, at every width 1 bit included."""
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(1)).relu()
    table = layout.rounding_table(x, 256)
    assert 0.45 < float(table[-1]) < 0.55
    for i, bits in enumerate(LADDER[:-1]):
        codec = NonzeroCodec(NonzeroConfig(bits=bits))
        errs = [(codec.decode(codec.encode(x, s)) - x).double().square().mean() for s in range(6)]
        assert float(sum(errs) / 6) == pytest.approx(float(table[i]), rel=0.08), bits
    dense = torch.randn(4096)
    assert float(layout.rounding_table(dense, 256)[-1]) == 1.0


class _ReluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _fit(policy, steps: int, batch: int) -> tuple[ActivationCompressor, list[float]]:
    """``steps`` compressed steps of a ReLU MLP under ``policy``; the engine (removed) and
    each step's measured gradient error."""
    torch.manual_seed(0)
    model = _ReluNet()
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    errors = []
    try:
        for step in range(steps):
            model.zero_grad()
            loss = lambda: nn.functional.cross_entropy(model(x), y)
            compressed_step(engine, model, loss, step)
            errors.append(policy.metrics().get("grad_error", 0.0))
    finally:
        engine.remove()
        policy.teardown()
    return engine, errors


def _acgc_ratio(monkeypatch, max_share: float) -> tuple[float, float, set[str]]:
    monkeypatch.setattr(layout, "NONZERO_MAX_SHARE", max_share)
    policy = build_policy("acgc", gradient_error=0.1, calibrate_every=1)
    engine, errors = _fit(policy, steps=6, batch=256)
    codecs = {r.codec for r in engine.stats.sites.values()}
    return engine.stats.ratio, max(errors), codecs


def test_acgc_stores_relu_outputs_by_their_non_zeros(monkeypatch) -> None:
    """On a ReLU MLP acgc picks ``nonzero`` for the ReLU outputs and keeps more memory
    than with the layout off, within its error on every calibration."""
    ratio, worst, codecs = _acgc_ratio(monkeypatch, 2 / 3)
    off_ratio, off_worst, off_codecs = _acgc_ratio(monkeypatch, 0.0)
    assert "nonzero" in codecs and "nonzero" not in off_codecs
    assert worst <= 0.1 and off_worst <= 0.1
    assert ratio > 1.1 * off_ratio, (ratio, off_ratio)


def test_nonzero_split_marks_only_positive_zero() -> None:
    x = torch.tensor([0.0, -0.0, 1.0, 0.0, float("nan")])
    mask, values = nonzero_split(x)
    assert mask.tolist() == [0b10110]
    assert values.numel() == 3


def test_the_layout_survives_a_checkpoint(monkeypatch) -> None:
    """A resumed policy stores the same tensors by their non-zeros before it calibrates."""
    policy = build_policy("acgc", gradient_error=0.1, calibrate_every=100)
    _fit(policy, steps=3, batch=128)
    sparse = policy.nonzero_shares()
    assert sparse and all(0 < s <= layout.NONZERO_MAX_SHARE for s in sparse.values())
    resumed = build_policy("acgc", gradient_error=0.1)
    resumed.load_state_dict(policy.state_dict())
    key = next(iter(sparse))
    assert resumed.quant_codec(key, 4).name == "nonzero"
    assert resumed.quant_codec("never seen", 4).name == "quant"
