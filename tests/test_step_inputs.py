"""The step's batch is saved as it is and counted as neither saved nor kept
(lightning_acgc.engine.step_inputs): the caller holds it all along, so a packed copy
would only add memory."""

from __future__ import annotations

import dataclasses
import gc

import torch
from _lightning_models import TinyMLP, fit
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine import ActivationCompressor, EngineSettings
from lightning_acgc.engine.step import compressed_step
from lightning_acgc.engine.step_inputs import MAX_DEPTH, StepInputs, tensors_in
from lightning_acgc.lightning import ActivationCompression
from lightning_acgc.policies import FixedPolicy


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    label: str


class Graph:
    """Like a PyTorch Geometric ``Data``: its tensors through ``to_dict``."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to_dict(self) -> dict:
        return {"x": self.x, "num_nodes": 3}


def test_tensors_are_found_in_nested_batches():
    a, b, c, d = (torch.full((i + 1,), float(i)) for i in range(4))
    found = list(tensors_in({"a": [a, (b, "text")], "pair": Pair(c, "y"), "g": Graph(d)}))
    assert [t.numel() for t in found] == [1, 2, 3, 4]
    deep: object = a
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    assert list(tensors_in(deep)) == []  # deeper than MAX_DEPTH: not followed
    assert list(tensors_in(None)) == list(tensors_in("text")) == list(tensors_in(3)) == []


def test_views_are_held_and_freed_tensors_are_not():
    x = torch.randn(8, 4)
    inputs = StepInputs()
    inputs.hold([x, torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), [], (2, 2))])
    assert inputs.holds(x.t()) and inputs.holds(x[3:])
    assert not inputs.holds(x.clone())
    inputs.hold(None)  # replaces what was held
    assert not inputs.holds(x)
    inputs.hold(torch.randn(8, 4))  # freed at once
    gc.collect()
    assert inputs.storages() == set()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def _step(inputs: object):
    model = _model()
    x = torch.randn(64, 32)
    policy = FixedPolicy(CodecSpec("quant", {"bits": 2}))
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    try:
        batch = x if inputs == "x" else inputs
        compressed_step(engine, model, lambda: model(x).square().mean(), 0, inputs=batch)
        return engine.stats, model[0].weight.grad.clone(), model, x
    finally:
        engine.remove()


def test_the_batch_is_saved_as_it_is_and_not_counted():
    held, grad_held, model, x = _step("x")
    packed, grad_packed, _, _ = _step(None)
    assert "0:0" not in held.sites and packed.sites["0:0"].codec == "quant"
    assert packed.saved_bytes - held.saved_bytes == x.numel() * x.element_size()
    # the first layer's weight gradient reads the exact batch: as plain's where the
    # rounding of the later tensors does not reach it (its output gradient is rounded)
    model.zero_grad()
    model(x).square().mean().backward()
    plain = model[0].weight.grad
    assert (grad_held - plain).norm() < (grad_packed - plain).norm()


def test_a_fit_saves_its_batch_as_it_is():
    cb = ActivationCompression(codec="quant", bits=2, print_table=False)
    model = TinyMLP()
    fit(model, [cb], max_steps=2, max_epochs=1)
    assert cb.stats is not None
    assert "net.0:0" not in cb.stats.sites  # the first Linear's input: the batch
    assert cb.stats.sites["net.2:0"].codec == "quant"


def test_compress_activations_takes_the_batch():
    model, x = _model(), torch.randn(64, 32)
    with compress_activations(model=model, codec="quant", bits=2, min_numel=0, inputs=[x]) as s:
        model(x).square().mean().backward()
    assert "0:0" not in s.sites and s.sites["1:0"].codec == "quant"
