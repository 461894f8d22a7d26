"""A calibration step of accumulated batches reads its error on the last batch: the only
one compressed under the settings that calibration chose (engine/last_batch.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc.engine import ActivationCompressor, EngineSettings
from lightning_acgc.engine.cycle import CalibrationCycle, exact_gradients
from lightning_acgc.engine.last_batch import LastBatch, held_gradients
from lightning_acgc.policies import build_policy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def test_as_step_scales_the_last_batch_error_by_root_k() -> None:
    step_sum = {"w": torch.tensor([1.0, 2.0])}
    own = {"w": torch.tensor([0.5, 0.5])}
    last = LastBatch(step_sum, own, batches=9, scale=1 / 9)
    got = last.as_step({"w": torch.tensor([0.5, 1.5]), "unknown": torch.ones(1)})
    assert list(got) == ["w"]  # only the parameters the exact gradient holds
    assert got["w"].tolist() == [1.0, 5.0]  # 1 + 3·0, 2 + 3·1


def test_held_gradients_are_copies_with_zeros_for_missing_ones() -> None:
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    held = held_gradients(model)
    assert list(held) == ["weight"] and torch.equal(held["weight"], torch.zeros(2, 3))
    model(torch.ones(1, 3)).sum().backward()
    held = held_gradients(model)
    model.weight.grad.zero_()
    assert torch.equal(held["weight"], torch.ones(2, 3))  # a copy, not the .grad itself


def accumulated_reading(
    device: torch.device, offload: bool
) -> tuple[float, float, float, LastBatch]:
    """Two batches into one calibration step on ``device``, driven as the Lightning
    adapter drives them; the first held exactly (no error at all), the second compressed
    under the step's settings. Returns the error the policy logged, the last batch's
    error against its own exact gradient times √2 over the step's ‖g‖ (by hand), the
    whole step's measured error, and the cycle's :class:`LastBatch`."""
    model = _model().to(device)
    policy = build_policy("acgc", gradient_error=0.1)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    engine.offload_exact = offload  # (the two held gradients wait in host memory)
    policy.setup(model)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(32, 16, generator=g).to(device),
            torch.randint(0, 4, (32,), generator=g).to(device),
        )
        for _ in range(2)
    ]
    try:
        cycle = CalibrationCycle(engine)
        assert cycle.begin(0)
        for i, (x, y) in enumerate(batches):

            def loss(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return F.cross_entropy(model(x), y)

            own = cycle.add_exact_gradient(model, loss, scale=0.5, last=i == 1)
            before = held_gradients(model)
            engine.new_step(i)
            with engine.scope() if i == 1 else engine.paused():
                compressed = loss() * 0.5
            compressed.backward()
        total = exact_gradients(
            engine, model, lambda: sum(F.cross_entropy(model(x), y) * 0.5 for x, y in batches)
        )
        last = cycle._last
        cycle.end(model)
    finally:
        engine.remove()
    assert own is not None and total is not None and last is not None
    g_sq = sum(float(t.pow(2).sum()) for t in total.values())
    last_sq = sum(
        float((p.grad - before[n] - own[n]).pow(2).sum()) for n, p in model.named_parameters()
    )
    whole_sq = sum(float((p.grad - total[n]).pow(2).sum()) for n, p in model.named_parameters())
    measured = policy.metrics()["grad_error"]
    return measured, math.sqrt(2 * last_sq / g_sq), math.sqrt(whole_sq / g_sq), last


@pytest.mark.parametrize("offload", [False, True])
def test_an_accumulated_calibration_reads_its_last_batch(offload: bool) -> None:
    """The error the policy logs is the last batch's against its own exact gradient,
    times √2 (the step's error if both batches had run under the settings), over the
    step's ‖g‖: here, the first batch held exactly, √2 times the whole step's error."""
    measured, expected, whole, _ = accumulated_reading(torch.device("cpu"), offload)
    assert measured == pytest.approx(expected, rel=1e-4)
    assert measured == pytest.approx(math.sqrt(2) * whole, rel=1e-4)
    assert measured > 0


@pytest.mark.parametrize("model", ["bert", "resnet"])
def test_accumulating_recipes_keep_the_ratio_of_single_batch_steps(model: str) -> None:
    """The quick recipes, 8 optimizer steps of one batch or of two accumulated: read on
    their last batch, the accumulated steps' calibrations keep about the same ratio. (Read
    on the whole step, which mixes in a batch compressed under the settings before the
    calibration, κ ran to 240 on BERT and 1.9 on the ResNet: 0.51 and 0.79 of the ratio.)"""
    from recipes.train import train
    from tests.test_recipes import compose

    ratios = []
    for accumulate in (1, 2):
        cfg = compose(
            f"model={model}", "compression=acgc", "trainer=fast", "trainer.max_epochs=1",
            f"trainer.limit_train_batches={8 * accumulate}",
            f"trainer.accumulate_grad_batches={accumulate}",
        )  # fmt: skip
        ratios.append(train(cfg)["acgc/ratio"])
    assert ratios[1] >= 0.9 * ratios[0], ratios
