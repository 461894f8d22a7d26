"""Compression under another default dtype: Lightning's ``precision="bf16-true"`` (and
``"16-true"``, ``"64-true"``) sets ``torch.set_default_dtype`` around the forward, so
every tensor made without a dtype there is bf16 (or float16, float64). The C codecs'
metadata buffers once were (4 bytes written per 2-byte element: a heap overflow that
aborted the fit); the codecs must give the same payload and decode whatever the default."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from lightning_acgc import ActivationCompression
from lightning_acgc.codecs.registry import build_codec
from lightning_acgc.policies import available_policies
from lightning_acgc.policies.quant_error import sr_variance
from tests._lightning_models import TinyMLP, fit

OTHER_DEFAULTS = (torch.bfloat16, torch.float16, torch.float64)
CODECS: list[tuple[str, dict[str, Any]]] = [
    ("quant", {"bits": 1}),
    ("quant", {"bits": 2}),
    ("quant", {"bits": 4, "meta": "bf16"}),
    ("quant", {"bits": 8}),
    ("bounded", {"error_bound": 0.01}),
    ("bounded", {"error_bound": 0.05, "relative": True}),
    ("division", {}),
    ("nonzero", {}),
    ("split", {}),
    ("half", {}),
    ("mask", {}),
    ("intpack", {}),
]


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _input(codec: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 100, generator=g)  # 6400 values: groups with a partial last one
    if codec == "mask":
        return (x > 0).to(dtype)
    if codec == "intpack":
        return torch.randint(0, 300, (64, 100), generator=g)
    x[3, 7], x[5, :4] = float("nan"), float("inf")  # the codecs' exception path too
    return x.relu().to(dtype) if codec == "nonzero" else x.to(dtype)


def _round_trip(codec: str, options: dict[str, Any], x: torch.Tensor) -> list[torch.Tensor]:
    coder = build_codec(codec, options)
    packed = coder.encode(x, 7)
    assert packed is not None, f"{codec} declined {x.dtype}"
    return [packed.payload[k] for k in sorted(packed.payload)] + [coder.decode(packed)]


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("codec", "options"), CODECS, ids=lambda v: str(v))
def test_codecs_alike_under_another_default_dtype(
    codec: str, options: dict[str, Any], x_dtype: torch.dtype
) -> None:
    if codec == "half" and x_dtype != torch.float32:
        pytest.skip("half declines what is already 16 bits")
    x = _input(codec, x_dtype)
    want = _round_trip(codec, options, x)
    for other in OTHER_DEFAULTS:
        with default_dtype(other):
            got = _round_trip(codec, options, x)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype, (other, g.dtype, w.dtype)
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=str(other))


def test_sr_variance_samples_the_same_groups_under_bf16_default() -> None:
    """Its evenly spaced groups: bf16 indices round (1023 -> 1024: past the last group)."""
    x = torch.rand(1023 * 64) + torch.arange(1023).repeat_interleave(64)
    want = sr_variance(x, 64, max_groups=1000)
    with default_dtype(torch.bfloat16):
        got = sr_variance(x, 64, max_groups=1000)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("policy", [p for p in available_policies() if p != "off"])
@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_every_policy_fits_in_true_precision(policy: str, precision: str) -> None:
    cb = ActivationCompression(policy=policy, print_table=False)
    trainer = fit(TinyMLP(), [cb], max_steps=4, precision=precision)
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    if precision == "64-true":  # the lossy codecs decline float64: kept as it is
        assert cb.stats.tensors_packed == 0 and cb.stats.tensors_kept > 0
    else:
        assert cb.stats.tensors_packed > 0
