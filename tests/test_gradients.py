"""End-to-end gradients under compression on four architectures (CNN, transformer, GNN, GRU)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from lightning_acgc import compress_activations
from tests._models import ARCHITECTURES, ResidualCNN, loss_of

ARCHS = sorted(ARCHITECTURES)


def _model(name: str) -> tuple[nn.Module, object]:
    make_model, make_inputs = ARCHITECTURES[name]
    torch.manual_seed(0)
    return make_model(), make_inputs()


def _grad(model: nn.Module, inputs: object, ctx: contextlib.AbstractContextManager | None = None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)  # identical dropout masks in every run
    with ctx if ctx is not None else contextlib.nullcontext():
        loss_of(model, inputs).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return torch.cat([g.flatten() for g in grads])


def _seed_runs(model: nn.Module, inputs: object, seeds: int) -> list[torch.Tensor]:
    """The gradient under 2-bit quant for each codec seed 0..seeds-1."""
    return [
        _grad(
            model,
            inputs,
            compress_activations(codec="quant", bits=2, model=model, min_numel=64, seed=s),
        )
        for s in range(seeds)
    ]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


@pytest.fixture
def deterministic():
    """Plain CPU index_add_ is not deterministic across threads: compare like with like."""
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    yield
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", ARCHS)
def test_identity_is_bit_identical(arch: str, deterministic: None) -> None:
    model, inputs = _model(arch)
    exact = _grad(model, inputs)
    with_hooks = _grad(
        model, inputs, compress_activations(codec="identity", model=model, min_numel=0)
    )
    assert torch.equal(exact, with_hooks)


@pytest.mark.parametrize("arch", ARCHS)
def test_quant_8bit_cosine(arch: str) -> None:
    model, inputs = _model(arch)
    exact = _grad(model, inputs)
    ctx = compress_activations(codec="quant", bits=8, model=model, min_numel=64)
    with ctx as stats:
        compressed = _grad(model, inputs, contextlib.nullcontext())
    assert stats.tensors_packed > 0
    assert _cos(compressed, exact) >= 0.999


@pytest.mark.parametrize("arch", ARCHS)
def test_quant_2bit_unbiased_over_seeds(arch: str) -> None:
    model, inputs = _model(arch)
    exact = _grad(model, inputs)
    runs = _seed_runs(model, inputs, 32)
    single = _cos(runs[0], exact)
    mean = _cos(torch.stack(runs).mean(0), exact)
    assert mean >= 0.98, (single, mean)
    assert mean > single  # averaging over seeds approaches the exact gradient


@pytest.mark.parametrize("arch", ARCHS)
def test_bounded_error_shrinks_with_bound(arch: str) -> None:
    """With an error bound eb on every saved element the gradient error is O(eb):
    a 10x tighter bound gives a ~10x smaller error, and a tight bound is close."""
    model, inputs = _model(arch)
    exact = _grad(model, inputs)
    errors = []
    for eb in (1e-3, 1e-4):
        ctx = compress_activations(  # the loss's own tensors bounded too: compress_loss
            codec="bounded", error_bound=eb, model=model, min_numel=64, compress_loss=True
        )
        got = _grad(model, inputs, ctx)
        errors.append(((got - exact).norm() / exact.norm()).item())
    assert errors[1] < 1e-2
    assert errors[1] < errors[0] / 4, errors


def test_cnn_ratio_and_bytes_checked_independently() -> None:
    model = ResidualCNN(width=32)
    x = torch.randn(32, 3, 32, 32)
    with compress_activations(codec="quant", bits=2, model=model, keep_packed=True) as stats:
        loss_of(model, x).backward()
        packed = list(stats.packed)
    assert stats.ratio >= 12
    # Bytes kept, counted independently: storages of every packed payload tensor.
    independent = sum(t.untyped_storage().nbytes() for p in packed for t in p.payload.values())
    kept = sum(r.packed_bytes for r in stats.sites.values() if r.codec == "kept")
    assert stats.packed_bytes == independent + kept
    # Saved bytes: every distinct saved activation of the plain graph, counted by hand.
    conv_bn_relu = {m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.BatchNorm2d))}
    assert len([r for r in stats.sites.values() if r.codec == "quant"]) >= len(conv_bn_relu) // 2
    assert stats.saved_bytes == sum(r.raw_bytes for r in stats.sites.values())
