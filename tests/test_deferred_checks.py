"""Encodes that do not wait for the device's verdict (``encode_deferred``), settled
later: the payload equals the checked encode's wherever the verdict passes, the slow
path takes over where it fails (NaN/inf, a range beyond float32), and the engine's byte
counts and memory follow. Under TRITON_INTERPRET=1 the verdict is a CPU tensor, in at
once; the waiting itself only a GPU exercises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.channels import ChannelNormalized
from lightning_acgc.codecs.deferred import DeferredCheck
from lightning_acgc.codecs.quant import QuantCodec, QuantWidthConfig
from lightning_acgc.codecs.split import SplitCodec, SplitConfig
from lightning_acgc.engine.checks import PendingChecks
from lightning_acgc.engine.saved import Saved


def _triton(codec):  # type: ignore[no-untyped-def]
    codec.backend = "triton"
    return codec


def _same_payload(a: Packed, b: Packed) -> None:
    assert a.codec == b.codec and list(a.payload) == list(b.payload) and a.meta == b.meta
    for key in a.payload:
        torch.testing.assert_close(a.payload[key], b.payload[key], atol=0, rtol=0, equal_nan=True)


def _settles_to_checked(codec, x: torch.Tensor, seed: int) -> Packed:  # type: ignore[no-untyped-def]
    """Encode ``x`` deferred and checked; after the decode settles the deferred one, both
    payloads and decodes agree bit for bit. Returns the settled packed tensor."""
    packed = codec.encode_deferred(x, seed=seed)
    assert packed is not None and packed.check is not None
    checked = codec.encode(x, seed=seed)
    assert checked is not None and checked.check is None
    y = codec.decode(packed)  # settles first
    assert packed.check is None
    _same_payload(packed, checked)
    torch.testing.assert_close(y, codec.decode(checked), atol=0, rtol=0, equal_nan=True)
    return packed


def _special(kind: str) -> torch.Tensor:
    x = torch.randn(3000).relu()
    if kind == "nan":
        x[5], x[2999] = float("nan"), float("inf")  # the tail group too
    elif kind == "huge":
        x[7], x[8] = 3e38, -3e38  # a range beyond float32 (1 bit: a step of inf)
    return x


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("kind", ["plain", "nan", "huge"])
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_quant_deferred_settles_to_the_checked_encode(kind: str, bits: int) -> None:
    codec = _triton(QuantCodec(QuantWidthConfig(bits=bits, group_size=64)))
    x = _special(kind)
    assert codec.encode_deferred(x, seed=9).check.ready()  # a CPU verdict: in at once
    packed = _settles_to_checked(codec, x, seed=9)
    if kind == "huge" and bits == 1:
        assert packed.codec == "identity" and torch.equal(codec.decode(packed), x)


@pytest.mark.parametrize("kind", ["plain", "nan"])
def test_split_deferred_checks_both_parts(kind: str) -> None:
    codec = _triton(SplitCodec(SplitConfig(bits=3, low_share=0.5, group_size=64)))
    _settles_to_checked(codec, _special(kind), seed=4)  # NaN in the lower part, inf upper


@pytest.mark.parametrize("kind", ["plain", "nan"])
def test_channel_normalized_deferred_keeps_its_channels(kind: str) -> None:
    """The BatchNorm-input wrapper defers through its inner codec, its check keeping the
    wrapper's own input; a failed verdict encodes that input again, channels and all."""
    inner = _triton(QuantCodec(QuantWidthConfig(bits=2, group_size=64)))
    codec = ChannelNormalized(inner)
    x = torch.randn(4, 6, 8, 8) * torch.logspace(-2, 2, 6).view(1, 6, 1, 1)
    if kind == "nan":
        x[1, 2, 3, 4] = float("nan")
    waiting = codec.encode_deferred(x, seed=5)
    assert waiting.check._source is x  # kept for a redo: x, not the fp32 normalized copy
    _settles_to_checked(codec, x, seed=5)


def test_paths_that_check_at_once_attach_no_check() -> None:
    x = torch.randn(1000)
    for backend in ("auto", "torch"):  # the compiled CPU path, the reference
        codec = QuantCodec(QuantWidthConfig(bits=2))
        codec.backend = backend
        packed = codec.encode_deferred(x, seed=1)
        assert packed is not None and packed.check is None
        _same_payload(packed, codec.encode(x, seed=1))


def test_failed_redo_keeps_the_tensor() -> None:
    x = torch.randn(100)

    def boom(source: torch.Tensor) -> Packed:
        raise RuntimeError("boom")

    packed = Packed("quant", x.shape, x.dtype, {"codes": torch.zeros(1)})
    packed.check = DeferredCheck([torch.tensor([2], dtype=torch.int32)], x, boom)
    with pytest.warns(UserWarning, match="boom"):
        packed.settle()
    assert packed.codec == "identity" and packed.payload["raw"] is x


class _Waiting:
    """A check whose verdict is not in until ``arrive``; then passes or fails."""

    def __init__(self, passes: bool, source: torch.Tensor) -> None:
        self.arrived, self.passes, self.source = False, passes, source

    def ready(self) -> bool:
        return self.arrived

    def replacement(self) -> Packed | None:
        self.arrived = True
        if self.passes:
            return None
        return Packed("identity", self.source.shape, self.source.dtype, {"raw": self.source})


def _holder(passes: bool) -> tuple[Saved, _Waiting]:
    x = torch.randn(64)
    packed = Packed("quant", x.shape, x.dtype, {"codes": torch.zeros(8, dtype=torch.uint8)})
    waiting = _Waiting(passes, x)
    packed.check = waiting  # type: ignore[assignment]
    return Saved(packed, None, "site", "quant"), waiting


def test_pending_checks_wait_for_no_more_than_the_limit() -> None:
    changes: list[int] = []
    pending = PendingChecks(lambda saved, delta: changes.append(delta), limit=1)
    first, first_check = _holder(passes=False)
    second, second_check = _holder(passes=True)
    pending.add(first)
    pending.poll()  # its verdict is not in: nothing settles, nothing waits
    assert len(pending) == 1 and first.packed.check is first_check
    pending.add(second)  # two waiting, limit one: the oldest is settled (waits for it)
    assert len(pending) == 1 and first.packed.check is None
    assert first.packed.codec == "identity" and changes == [64 * 4 - 8]
    second_check.arrived = True
    pending.poll()
    assert len(pending) == 0 and second.packed.codec == "quant" and changes == [248]
    third, _ = _holder(passes=True)
    pending.add(third)
    del third  # autograd dropped it: its check is forgotten, never settled
    pending.settle_all()
    assert len(pending) == 0


def _step(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Gradients and packed bytes of one step (quant 4 bits, Triton path); checks that
    backward settled every check and that nothing stays charged after it."""
    model.zero_grad()
    with compress_activations(
        codec="quant", bits=4, backend="triton", model=model, keep_packed=True, min_numel=0
    ) as stats:
        model(x).nan_to_num().sum().backward()
        packed = stats.packed  # type: ignore[attr-defined]
        assert packed and all(p.check is None for p in packed)
    assert stats.live_bytes == 0
    return [p.grad.clone() for p in model.parameters()], stats.packed_bytes


@pytest.mark.parametrize("special", [False, True])
def test_engine_defers_and_counts_the_settled_bytes(
    special: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the engine: the packed bytes count what the checked encode holds (also
    where an inf brought an exception after the verdict), and the gradients equal the
    checked encode's, bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(256, 64)
    if special:
        x[3, 5] = float("inf")  # the first Linear saves its input: one exception
    grads, counted = _step(model, x)
    monkeypatch.setattr(QuantCodec, "encode_deferred", QuantCodec.encode)
    checked, counted_checked = _step(model, x)
    assert counted == counted_checked
    for a, b in zip(grads, checked, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("codec_kind", ["quant", "split", "channels"])
@pytest.mark.parametrize("kind", ["plain", "nan", "huge"])
def test_deferred_on_gpu_settles_to_the_checked_encode(kind: str, codec_kind: str) -> None:
    """On a GPU the verdict comes through pinned memory behind an event: settling waits
    for it, and a failed verdict (NaN/inf, a range beyond float32) gives the checked
    encode's payload."""
    inner = QuantCodec(QuantWidthConfig(bits=1 if kind == "huge" else 2, group_size=64))
    codec = {
        "quant": inner,
        "split": SplitCodec(SplitConfig(bits=3, low_share=0.5, group_size=64)),
        "channels": ChannelNormalized(inner),
    }[codec_kind]
    x = _special(kind).cuda()
    if codec_kind == "channels":
        x = x.view(3, 10, 100)
    _settles_to_checked(codec, x, seed=9)
