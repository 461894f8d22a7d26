"""A product the engine remakes at unpack (a convolution's output that a BatchNorm
saved, a Linear's that a GELU saved) is freed after forward: its derivation keeps what
remakes it, not the output (a closure that read ``base.dtype`` held every such output of
ResNet-50 alive, 62 MB more at the step's peak)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from lightning_acgc import ActivationCompressor, build_policy, compressed_step
from lightning_acgc.engine.settings import EngineSettings


class _Net(nn.Module):
    def __init__(self, stem: bool = True) -> None:
        super().__init__()
        # with a stem the convolution's input is saved (by it), so its output is remade
        self.stem = nn.Conv2d(3, 8, 3, padding=1) if stem else None
        self.conv = nn.Conv2d(8 if stem else 3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 16 * 16, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stem is not None:
            x = torch.relu(self.stem(x))
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        return self.head(nn.functional.gelu(self.fc(h)))


def _freed_after_forward(model: nn.Module, error: float) -> tuple[dict[str, bool], str]:
    """Whether the tracked outputs were alive after the forward of a compressed step
    (after the calibrations), and the step's site table."""
    x = torch.randn(8, 3, 16, 16)
    outputs: dict[str, weakref.ref] = {}
    alive: list[dict[str, bool]] = []

    def keep_ref(name: str):
        def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
            outputs[name] = weakref.ref(out)

        return hook

    model.conv.register_forward_hook(keep_ref("conv"))
    model.fc.register_forward_hook(keep_ref("fc"))

    def loss() -> torch.Tensor:
        value = model(x).square().sum()
        gc.collect()
        alive.append({name: ref() is not None for name, ref in outputs.items()})
        return value

    policy = build_policy("acgc", gradient_error=error, calibrate_every=100)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    policy.setup(model)
    try:
        # three calibrations, up to three more (acgc calibrates again after a broken
        # one: BROKEN_RETRIES), then a compressed step alone
        for step in range(7):
            compressed_step(engine, model, loss, step, inputs=x)
        table = engine.stats.table()
    finally:
        engine.remove()
    return alive[-1], table


def test_a_remade_convolution_output_is_not_held_after_forward() -> None:
    torch.manual_seed(0)
    alive, table = _freed_after_forward(_Net(), error=0.5)
    assert "bn:0" in table and "recomputed conv of" in table, table  # BatchNorm's input
    assert not alive["conv"], table


def test_a_remade_linear_output_is_not_held_after_forward() -> None:
    torch.manual_seed(0)
    alive, table = _freed_after_forward(_Net(stem=False), error=0.05)
    assert "recomputed linear of fc:0" in table, table  # the GELU's input
    assert not alive["fc"], table
