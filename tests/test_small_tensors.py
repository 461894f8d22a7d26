"""Small saved tensors (under ``min_numel``) encoded together in chunks."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from benchmarks.coverage import GOALS, measure
from lightning_acgc import ActivationCompression, compress_activations
from lightning_acgc.engine import ActivationCompressor
from lightning_acgc.engine.settings import EngineSettings
from lightning_acgc.policies import build_policy


def _gru() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.rnn = nn.GRU(16, 32, num_layers=2, batch_first=True)  # 8 x 32 = 256 per step
    x = torch.randn(8, 20, 16)
    return model, x


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.rnn(x)[0].square().mean()


def _grads(model: nn.Module) -> torch.Tensor:
    out = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def test_gru_of_small_steps_reaches_its_goal_at_the_default_threshold() -> None:
    ratio, table = measure("gru")
    assert ratio >= GOALS["gru"], table
    ratio_raw, _ = measure("gru", coalesce_min_numel=None)
    assert ratio_raw < 2.0  # without chunks the per-step tensors stay raw


def test_small_steps_are_packed_and_gradients_stay_close() -> None:
    model, x = _gru()
    _loss(model, x).backward()
    exact = _grads(model)
    with compress_activations(codec="quant", bits=8, model=model) as stats:
        _loss(model, x).backward()
    got = _grads(model)
    assert stats.ratio >= 3.5 and stats.tensors_packed > 100
    assert not any(r.codec == "kept" and r.settings == "tiny" for r in stats.sites.values())
    assert torch.nn.functional.cosine_similarity(got, exact, dim=0) > 0.999
    with compress_activations(codec="quant", bits=8, model=model, coalesce_min_numel=None) as raw:
        _loss(model, x).backward()
    assert raw.ratio < 1.5  # without chunks the per-step tensors stay raw


def test_site_shares_sum_to_the_packed_bytes_and_ledger_ends_empty() -> None:
    model, x = _gru()
    engine = ActivationCompressor(build_policy("fixed", codec="quant", bits=2), model=model)
    engine.install()
    try:
        for step in range(2):
            engine.new_step(step)
            with engine.scope() as stats:
                loss = _loss(model, x)
            assert stats.live_bytes < stats.saved_bytes / 4  # encoded at the scope's end
            loss.backward()
            del loss
            gc.collect()
            assert stats.live_bytes == 0
            assert sum(r.packed_bytes for r in stats.sites.values()) == stats.packed_bytes
            assert stats.ratio >= 4.0
    finally:
        engine.remove()


def test_retain_graph_second_backward_matches_the_first() -> None:
    model, x = _gru()
    with compress_activations(codec="quant", bits=4, model=model):
        loss = _loss(model, x)
    loss.backward(retain_graph=True)
    first = _grads(model)
    loss.backward()
    assert torch.equal(_grads(model), first)  # the same packed values decoded again


def test_double_backward_through_small_tensors() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(16, 8, requires_grad=True)  # 128 elements per saved tensor
    # tanh and square run outside the model: stand-ins for its ops, so compressed too
    with compress_activations(codec="quant", bits=8, model=lin, compress_loss=True) as stats:
        y = torch.tanh(lin(x)).square().sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.square().sum().backward()
    assert stats.tensors_packed > 0 and torch.isfinite(lin.weight.grad).all()


def test_tensors_waiting_in_a_chunk_are_unpacked_raw_when_the_scope_raises() -> None:
    model, x = _gru()
    ctx = compress_activations(codec="quant", bits=2, model=model)
    with pytest.raises(RuntimeError, match="boom"), ctx as stats:
        loss = _loss(model, x)
        raise RuntimeError("boom")
    raised = [r for r in stats.sites.values() if r.settings == "step raised"]
    assert len(raised) > 100 and all(r.codec == "kept" for r in raised)
    loss.backward()  # the waiting tensors are unpacked raw
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    del loss
    gc.collect()
    assert stats.live_bytes == 0


def test_coalesce_min_numel_is_checked() -> None:
    with pytest.raises(ValueError, match="coalesce_min_numel=-1"):
        EngineSettings(coalesce_min_numel=-1)
    assert EngineSettings(coalesce_min_numel=None).coalesce_min_numel is None


def test_the_callback_and_its_config_pass_the_chunk_threshold_on() -> None:
    assert ActivationCompression(print_table=False).settings.coalesce_min_numel == 64
    off = ActivationCompression(coalesce_min_numel=None, print_table=False)
    assert off.settings.coalesce_min_numel is None
    with pytest.raises(ValueError, match="coalesce_min_numel=-1"):
        ActivationCompression(coalesce_min_numel=-1, print_table=False)
