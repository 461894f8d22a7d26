"""Smooth and kinked checkpointed regions (``policies/checkpoint_regions.py``): acgc reads
off the graph whether a region holds an op whose derivative jumps, stores the inputs of
smooth ones at 8 bits at least (float16 where kinked or not known), and each hold moves a
class one step up: 8 bits -> float16 -> kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_acgc import (
    ActivationCompressor,
    CheckpointedModules,
    EngineSettings,
    build_policy,
    compressed_step,
)
from lightning_acgc.engine.derive_graph import Origin
from lightning_acgc.policies.bit_allocation import HALF, KEEP
from lightning_acgc.policies.checkpoint_regions import RegionKinds, kinked_between


class _Block(nn.Module):
    def __init__(self, width: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.gelu(h) if self.act == "gelu" else F.relu(h)
        return self.norm(x + self.fc2(h))


class _Stack(nn.Module):
    def __init__(self, act: str, blocks: int = 3, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.Sequential(*[_Block(width, act) for _ in range(blocks)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(1))


def _fit(act: str, steps: int, **options: object) -> tuple[list[float], object, object]:
    """``steps`` steps of SGD with every block checkpointed, calibrating every step;
    (each step's measured gradient error, the policy, the engine's stats)."""
    torch.manual_seed(0)
    model = _Stack(act)
    CheckpointedModules("_Block").install(model)
    policy = build_policy("acgc", gradient_error=0.05, calibrate_every=1, **options)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    policy.setup(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 24, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    errors = []
    try:
        for step in range(steps):
            compressed_step(engine, model, lambda: F.cross_entropy(model(x), y), step)
            errors.append(policy.metrics()["grad_error"])
            model.zero_grad()
        return errors, policy, engine.stats
    finally:
        engine.remove()
        policy.teardown()


def test_a_walk_reads_the_ops_between_two_tensors() -> None:
    x = torch.randn(3, 4, requires_grad=True) * 2
    start = Origin.of(x)
    assert kinked_between(F.layer_norm(F.gelu(x @ torch.ones(4, 4)), (4,)), start) is False
    assert kinked_between(x.clamp(min=0).sum(), start) is True
    assert kinked_between(F.max_pool1d(x[None], 2).sum(), start) is True
    assert kinked_between(torch.ones(2, requires_grad=True).sum(), start) is None
    # reentrant checkpointing: one custom Function, its ops out of sight
    assert kinked_between(checkpoint(torch.tanh, x, use_reentrant=True).sum(), start) is True


def test_inputs_outside_the_graph_are_neither_read_nor_reading() -> None:
    kinds = RegionKinds()
    x = torch.randn(4, requires_grad=True) * 1.0
    kinds.note("a", x)
    kinds.note("mask", torch.zeros(4))  # an attention mask: no grad
    kinds.note("a", torch.tanh(x) * 2)
    assert kinds.kinked == {"a": False} and kinds.smooth("a") and not kinds.smooth("mask")
    r = torch.relu(x)
    kinds.note("a", r)  # not reached from the last one: says nothing
    kinds.note("a", torch.relu(r + 1))
    assert kinds.kinked == {"a": True} and not kinds.smooth("a")
    kinds.forget()  # a new step: its first input reads nothing, nothing old is held
    kinds.note("a", torch.tanh(r) * 1.0)
    assert kinds.kinked == {"a": True} and kinds._last is not None


def test_each_step_lets_the_last_steps_node_go() -> None:
    _, policy, _ = _fit("gelu", 2)
    assert policy._regions._last is not None  # the last calibration's last input
    policy.begin_step(2)
    assert policy._regions._last is None


@pytest.mark.parametrize(("act", "floor"), [("gelu", 8), ("relu", HALF)])
def test_smooth_regions_inputs_go_to_8_bits_kinked_ones_stay_float16(act: str, floor: int) -> None:
    errors, policy, _ = _fit(act, 4)
    inputs = sorted(policy._checkpoint_inputs)
    assert len(inputs) == 3
    assert policy._regions.kinked == {"blocks.*:0": act == "relu"}
    assert all(policy.floors()[k] == floor for k in inputs)
    assert all(policy.site_bits[k] in (floor, HALF, KEEP) for k in inputs)
    assert max(errors) <= 0.05, errors
    state = policy.state_dict()
    assert state["checkpoint_kinked"] == {"blocks.*:0": act == "relu"}


def test_each_hold_moves_a_class_one_step_up_and_old_states_load() -> None:
    _, policy, _ = _fit("gelu", 2)
    keys = sorted(policy._checkpoint_inputs)
    assert policy._class_floor("blocks.*:0") == 8
    policy.hold_all_checkpoint_inputs()
    assert policy._checkpoint_held == {"blocks.*:0": HALF}
    assert policy.floors()[keys[0]] == HALF
    assert policy._hold_checkpoint_inputs(keys)  # a layer around them over its budget
    assert policy._checkpoint_held == {"blocks.*:0": KEEP}
    assert not policy._hold_checkpoint_inputs(keys)  # kept: nothing further
    resumed = build_policy("acgc", gradient_error=0.05)
    resumed.load_state_dict(policy.state_dict())
    assert resumed._checkpoint_held == {"blocks.*:0": KEEP}
    assert resumed._regions.kinked == {"blocks.*:0": False}
    old = {**policy.state_dict(), "checkpoint_held": ["blocks.*:0"]}  # before graded holds
    old.pop("checkpoint_kinked")
    resumed.load_state_dict(old)
    assert resumed._checkpoint_held == {"blocks.*:0": KEEP} and resumed._regions.kinked == {}
