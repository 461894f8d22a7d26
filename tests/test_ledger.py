"""The live-bytes ledger: exact under failure, views charged once by storage."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from lightning_acgc.engine import ActivationCompressor, EngineSettings, MemoryBudgetError
from lightning_acgc.policies import build_policy


def _engine(codec: str = "quant", budget: int | None = None, **options: object):
    policy = build_policy("fixed", codec=codec, **options)
    engine = ActivationCompressor(
        policy, settings=EngineSettings(min_numel=0), memory_budget=budget
    )
    engine.install()
    engine.new_step(0)
    return engine


class _Boom(nn.Module):
    """Raises in the middle of the forward, after earlier layers saved tensors."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a fresh instance each call: a raised one keeps its traceback (and the graph)
        raise type(self.error)(*self.error.args)


def _model(error: BaseException | None = None) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh()]
    if error is not None:
        layers.append(_Boom(error))
    return nn.Sequential(*layers)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("boom: a user error"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        ValueError("bad batch"),
    ],
)
@pytest.mark.parametrize("codec", ["quant", "identity"])
def test_a_step_that_raised_releases_everything_it_charged(
    error: BaseException, codec: str
) -> None:
    engine = _engine(codec)
    model = _model(error)
    with pytest.raises(type(error)), engine.scope():
        model(torch.randn(32, 64))
    # pytest.raises keeps the traceback (and so the graph) until the block is left
    assert engine.stats.live_bytes == 0
    assert engine.stats.peak_live_bytes > 0


def test_budget_error_releases_the_bytes_of_the_failed_step() -> None:
    """The regression of the batch search: bytes charged by a step that passed the budget
    stayed charged, so every later step started over budget."""
    model = _model()
    engine = _engine("quant", budget=40_000, bits=8)
    with pytest.raises(MemoryBudgetError), engine.scope():
        model(torch.randn(512, 64)).sum().backward()
    assert engine.stats.live_bytes == 0
    engine.new_step(1)
    with engine.scope():  # a smaller step fits again
        model(torch.randn(8, 64)).sum().backward()
    assert engine.stats.live_bytes == 0


def test_new_step_collects_a_failed_graph_kept_by_a_reference_cycle() -> None:
    model = _model(RuntimeError("boom"))
    engine = _engine("quant", budget=10**9)
    try:
        with engine.scope():
            model(torch.randn(32, 64))
    except RuntimeError as err:
        cycle: list[object] = [err]
        cycle.append(cycle)  # the exception (traceback, frames, graph) in a cycle
        del cycle
    gc.disable()
    try:
        assert engine.stats.live_bytes > 0  # only the cycle holds the graph
        engine.new_step(1)
        assert engine.stats.live_bytes == 0
    finally:
        gc.enable()


def test_saved_outputs_kept_raw_are_released() -> None:
    """exp and tanh save their outputs: returning them with their grad_fn from the pack
    hook made a reference cycle through autograd's graph, never released."""
    engine = _engine("identity")
    w = torch.randn(256, 64, requires_grad=True)
    x = w * 1.0
    with engine.scope():
        y = x.exp().tanh()
    assert engine.stats.live_bytes == 2 * x.numel() * 4
    y.sum().backward()
    del y
    assert engine.stats.live_bytes == 0
    # the backward ran through the kept tensors
    torch.testing.assert_close(w.grad, (1 - w.exp().tanh() ** 2) * w.exp())


def test_views_of_one_storage_are_charged_once() -> None:
    engine = _engine("identity")
    x = torch.randn(64, 64, requires_grad=True) * 1.0
    storage = x.numel() * 4
    with engine.scope():
        a = x[:48].sin()  # overlapping views: 1.5x the storage by their spans
        b = x[16:].cos()
        c = x.t().sin()
    assert engine.stats.saved_bytes == storage
    assert engine.stats.packed_bytes == storage
    assert engine.stats.live_bytes == storage
    del a, b
    assert engine.stats.live_bytes == storage  # c still holds a view
    del c
    assert engine.stats.live_bytes == 0


def test_new_step_resets_the_step_counters_and_sharing() -> None:
    engine = _engine("quant", bits=8)
    lin = nn.Linear(64, 64)
    x = torch.randn(128, 64)
    with engine.scope():
        lin(x).relu().sum().backward()
    first = engine.stats.saved_bytes
    engine.new_step(1)
    assert engine.stats.saved_bytes == engine.stats.packed_bytes == 0
    assert not engine.stats.sites
    with engine.scope():
        lin(x).relu().sum().backward()  # the same input storage is counted again
    assert engine.stats.saved_bytes == first
    assert engine.stats.live_bytes == 0
