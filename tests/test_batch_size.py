"""COMET-style batch-size raising: Lightning's tuner, a memory budget, compression on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _lightning_models import ProbePolicy, TinyCNN, TinyMLP, fit
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.memory import is_oom_error
from torch import nn

from lightning_acgc.batch_size import (
    CompressedBatchSizeFinder,
    lr_factor,
    parse_memory,
    static_memory_bytes,
)
from lightning_acgc.callback import ActivationCompression
from lightning_acgc.config import CompressionConfig
from lightning_acgc.engine import ActivationCompressor, MemoryBudgetError
from lightning_acgc.policies import build_policy
from lightning_acgc.strategy import ACGCStrategy

BUDGET = "256KiB"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1000, 1000),
        ("2GB", 2 * 10**9),
        ("2 gib", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5KB", 1500),
        ("300", 300),
        ("64B", 64),
        (None, None),
    ],
)
def test_parse_memory(value: object, expected: int | None) -> None:
    assert parse_memory(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -5, True, "2XB", "GB", "-1GB", "0MB", 1.5, [1]])
def test_parse_memory_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="memory_budget="):
        parse_memory(value)  # type: ignore[arg-type]


def test_static_memory_counts_optimizer_state() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10))
    params = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(model.parameters())
    assert static_memory_bytes(model, [sgd]) == 2 * params + buffers
    assert static_memory_bytes(model, [momentum]) == 3 * params + buffers
    assert static_memory_bytes(model, [adam]) == 4 * params + buffers
    model(torch.randn(4, 10)).sum().backward()
    adam.step()  # real state (exp_avg, exp_avg_sq, step) replaces the estimate
    assert static_memory_bytes(model, [adam]) >= 4 * params + buffers


def test_lr_factor() -> None:
    assert lr_factor(8, 32, "linear") == 4.0
    assert lr_factor(8, 32, "sqrt") == 2.0
    with pytest.raises(ValueError, match="lr_scaling='cubic'"):
        lr_factor(8, 32, "cubic")


def test_budget_error_is_an_oom_error_for_lightning() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    engine = ActivationCompressor(
        build_policy("fixed", codec="quant", bits=2), model=model, memory_budget=4096
    )
    engine.install()
    engine.new_step(0)
    try:
        with pytest.raises(MemoryBudgetError) as info, engine.scope():
            model(torch.randn(128, 64)).sum().backward()
    finally:
        engine.remove()
    assert is_oom_error(info.value)


def test_budget_without_search_raises_in_training() -> None:
    cb = ActivationCompression(codec="quant", bits=2, memory_budget=4096, print_table=False)
    with pytest.raises(MemoryBudgetError, match="can't allocate memory"):
        fit(TinyMLP(batch_size=64), [cb], max_steps=1)


def test_finder_is_not_a_callback_of_its_own() -> None:
    finder = CompressedBatchSizeFinder("power")
    with pytest.raises(MisconfigurationException, match="runs inside ActivationCompression"):
        fit(TinyCNN(), [finder], max_steps=1)


def _search(
    tmp_path: Path, mode: str, **options: object
) -> tuple[TinyCNN, Trainer, ActivationCompression]:
    finder = CompressedBatchSizeFinder(mode, steps_per_trial=1, max_val=4096)
    cb = ActivationCompression(
        scale_batch_size=finder,
        memory_budget=BUDGET,
        lr_scaling="linear",
        print_table=False,
        **options,
    )
    model = TinyCNN(batch_size=2, lr=0.01)
    trainer = fit(model, [cb], limit_train_batches=2, default_root_dir=str(tmp_path))
    return model, trainer, cb


def test_compressed_search_finds_a_batch_8x_larger(tmp_path: Path) -> None:
    """Both searches by Lightning's tuner in one fit: the identity codec under the budget,
    then quant 2 bits under the same budget."""
    model, trainer, cb = _search(tmp_path, "power", codec="quant", bits=2)
    finder = cb.batch_size_finder
    assert finder is not None
    found, plain = finder.compressed_batch_size, finder.uncompressed_batch_size
    assert plain is not None and found is not None and plain >= 4
    assert found >= 8 * plain
    # the run goes on at the size found, within the budget (no error was raised)
    assert model.batch_size == found and trainer.train_dataloader.batch_size == found
    assert model.batch_sizes_seen[-2:] == [found, found]
    assert cb.stats.peak_live_bytes + cb.engine.budget_base <= parse_memory(BUDGET)
    # the learning rate followed the batch size up to max_lr_factor, and everything
    # was logged
    factor = min(found / 2, finder.max_lr_factor)
    assert finder.lr_factor == factor and finder.lr_factor_wanted == found / 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * factor)
    metrics = trainer.callback_metrics
    assert metrics["acgc/batch_size"] == found
    assert metrics["acgc/batch_size_uncompressed"] == plain
    assert metrics["acgc/lr_factor"] == pytest.approx(factor)
    assert not list(tmp_path.glob(".scale_batch_size_*"))


@pytest.mark.slow
def test_binsearch_mode(tmp_path: Path) -> None:
    model, _, cb = _search(tmp_path, "binsearch", codec="quant", bits=2)
    finder = cb.batch_size_finder
    assert finder is not None
    assert finder.compressed_batch_size >= 8 * finder.uncompressed_batch_size
    assert model.batch_sizes_seen[-2:] == [finder.compressed_batch_size] * 2


def test_search_runs_after_a_calibration_step(tmp_path: Path) -> None:
    policy = ProbePolicy(CompressionConfig(codec="quant", codec_options={"bits": 2}), 1000)
    finder = CompressedBatchSizeFinder("power", steps_per_trial=1, compare_uncompressed=False)
    cb = ActivationCompression(
        policy, scale_batch_size=finder, memory_budget=BUDGET, print_table=False
    )
    model = TinyCNN()
    # through the compression strategy this time (the other tests wrap a stock one)
    trainer = fit(
        model, [cb], max_steps=1, default_root_dir=str(tmp_path), strategy="acgc", devices="auto"
    )
    # calibration step (with the exact gradient) before the search, whose trials run
    # without callbacks; then the real step 0
    assert policy.calls[:5] == [
        ("setup", "TinyCNN"),
        ("begin", 0),
        ("exact", 8),
        ("end", 0),
        ("begin", 0),
    ]
    assert finder.uncompressed_batch_size is None and finder.compressed_batch_size > 16
    assert model.batch_sizes_seen[0] == 2  # the calibration step ran at the initial size
    assert isinstance(trainer.strategy, ACGCStrategy) and trainer.strategy._acgc_scope is None


def test_without_search_nothing_changes(tmp_path: Path) -> None:
    cb = ActivationCompression(codec="quant", bits=2, print_table=False)
    model = TinyCNN(batch_size=4, lr=0.01)
    trainer = fit(model, [cb], limit_train_batches=2, default_root_dir=str(tmp_path))
    assert cb.batch_size_finder is None
    assert model.batch_size == 4 and model.batch_sizes_seen == [4, 4]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.01
    assert "acgc/batch_size" not in trainer.callback_metrics
    assert not list(tmp_path.iterdir())
