"""COMET-style batch-size raising: Lightning's tuner, a memory budget, compression on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _lightning_models import ProbePolicy, TinyCNN, TinyMLP, fit
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.memory import is_oom_error
from torch import nn

from lightning_acgc.codecs import CodecSpec
from lightning_acgc.engine import ActivationCompressor, MemoryBudgetError
from lightning_acgc.lightning.batch_search import search_sizes
from lightning_acgc.lightning.batch_size import CompressedBatchSizeFinder, lr_factor
from lightning_acgc.lightning.callback import ActivationCompression
from lightning_acgc.lightning.memory import parse_memory, static_memory_bytes
from lightning_acgc.lightning.strategy import ACGCStrategy
from lightning_acgc.policies import build_policy
from lightning_acgc.policies.fixed import FixedPolicy

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
    policy = ProbePolicy(CodecSpec("quant", {"bits": 2}), 1000)
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


# -- the size search (pure) and its regressions -------------------------------------
def _sizes(limit: int | None, **options: object) -> tuple[object, list[int]]:
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return limit is None or n <= limit

    kwargs = dict(mode="binsearch", init_val=2, max_val=8192, max_trials=25, margin=0.05)
    kwargs.update(options)
    return search_sizes(fits, **kwargs), tried  # type: ignore[arg-type]


def test_search_sizes_margin_is_applied_once_and_only_after_a_failure() -> None:
    result, tried = _sizes(100)
    assert result.largest_fit == 100 and result.failed == 101 and result.size == 95
    assert tried[:7] == [2, 4, 8, 16, 32, 64, 128]
    # limited by max_val, never failed: no margin, and max_val itself was tried
    result, tried = _sizes(None, max_val=179)
    assert result.size == result.largest_fit == 179 and result.limit == 179
    assert tried[-1] == 179
    # power mode keeps the last size that fitted
    result, _ = _sizes(100, mode="power")
    assert result.size == 64


def test_search_sizes_stops_at_the_cap_after_a_failure_there() -> None:
    """The hang: failing at the data set's size retried that size forever."""
    result, tried = _sizes(300, max_val=512)
    assert result.largest_fit == 300 and result.size == 285
    assert len(tried) <= 20 and tried.count(512) == 1


def test_search_sizes_goes_below_init_val_and_fails_clearly() -> None:
    result, tried = _sizes(3, init_val=16)
    assert result.largest_fit == 3 and tried[:3] == [16, 8, 4]
    with pytest.raises(RuntimeError, match="batch size 1 does not fit"):
        _sizes(0)


class WideCNN(TinyCNN):
    """Wider than TinyCNN, so that under the budget the uncompressed search fails trials
    (and leaves the bytes of those failed steps behind, before the ledger was exact)."""

    def __init__(self, samples: int = 4096) -> None:
        super().__init__(batch_size=2, samples=samples, lr=0.01)
        self.net[0] = nn.Conv2d(3, 32, 3, padding=1)
        self.net[2] = nn.Conv2d(32, 16, 3, padding=1, stride=2)


def _found(tmp_path: Path, compare: bool, budget: str = "2MB") -> CompressedBatchSizeFinder:
    finder = CompressedBatchSizeFinder("binsearch", steps_per_trial=1, compare_uncompressed=compare)
    cb = ActivationCompression(
        codec="quant", bits=2, scale_batch_size=finder, memory_budget=budget, print_table=False
    )
    fit(WideCNN(), [cb], max_steps=1, default_root_dir=str(tmp_path))
    assert cb.stats is not None and cb.stats.live_bytes == 0
    return finder


@pytest.mark.slow
def test_compare_mode_finds_what_the_compressed_search_finds_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    both, alone = _found(tmp_path, True), _found(tmp_path, False)
    assert both.uncompressed_batch_size is not None and both.uncompressed_batch_size >= 2
    assert both.compressed_batch_size == alone.compressed_batch_size
    assert both.compressed_batch_size > 4 * both.uncompressed_batch_size
    assert not list(tmp_path.rglob("*.ckpt"))  # nothing left behind


@pytest.mark.slow
def test_search_stops_at_the_data_set_without_hanging(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """policy='acgc', binsearch, 20MB on 512 samples used to loop forever on
    'The batch size 512 is greater or equal than the length of your dataset'."""
    finder = CompressedBatchSizeFinder("binsearch", steps_per_trial=1)
    cb = ActivationCompression(
        policy="acgc", scale_batch_size=finder, memory_budget="20MB", print_table=False
    )
    model = TinyCNN(batch_size=2, samples=512)
    with caplog.at_level("INFO"):
        fit(model, [cb], max_steps=1, default_root_dir=str(tmp_path))
    assert finder.compressed_batch_size == finder.uncompressed_batch_size == 512 // 8
    assert model.batch_size == 64
    note = "the data set (512 samples) limits the batch to 64"
    assert any(note in r.message for r in caplog.records)


def test_search_on_cpu_without_budget_refuses(tmp_path: Path) -> None:
    cb = ActivationCompression(codec="quant", bits=2, scale_batch_size="binsearch")
    with pytest.raises(ValueError, match="scale_batch_size on CPU needs memory_budget"):
        fit(TinyCNN(samples=64), [cb], max_steps=1, default_root_dir=str(tmp_path))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_lr_factor": 0.5}, "max_lr_factor=0.5"),
        ({"min_steps_per_epoch": 0}, "min_steps_per_epoch=0"),
    ],
)
def test_finder_rejects_bad_bounds(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CompressedBatchSizeFinder("binsearch", **options)


class GrowsWhenTrainingStarts(FixedPolicy):
    """quant 2-bit through the search, 8-bit from the first training step on: a policy
    that keeps more bytes after the search than during it (as acgc's and comet's
    recalibrations can)."""

    name = "grows"

    def __init__(self) -> None:
        super().__init__(CodecSpec("quant", {"bits": 2}))
        self.wide = CodecSpec("quant", {"bits": 8}).build()
        self.grown = False

    def codec_for(self, site, x):  # type: ignore[no-untyped-def]
        return self.wide if self.grown else self.codec


class _Grow(Callback):
    def __init__(self, policy: GrowsWhenTrainingStarts) -> None:
        self.policy = policy

    def on_train_start(self, trainer: Trainer, pl_module: object) -> None:
        self.policy.grown = True


@pytest.mark.parametrize("headroom", [0.0, 0.75])
def test_headroom_keeps_training_within_the_budget_when_the_policy_grows(
    tmp_path: Path, headroom: float
) -> None:
    """8-bit keeps about 3.7x the bytes of 2-bit. Without headroom the size found fills
    more than half the budget's activation room (twice it failed), so the first training
    step goes over; with 75% headroom the trials had a quarter of the room."""
    policy = GrowsWhenTrainingStarts()
    finder = CompressedBatchSizeFinder(
        "power", steps_per_trial=1, max_val=4096, compare_uncompressed=False, headroom=headroom
    )
    cb = ActivationCompression(
        policy, scale_batch_size=finder, memory_budget=BUDGET, print_table=False
    )
    model = TinyCNN(batch_size=2, lr=0.01)
    if headroom == 0.0:
        with pytest.raises(MemoryBudgetError):
            fit(model, [cb, _Grow(policy)], max_steps=2, default_root_dir=str(tmp_path))
        return
    fit(model, [cb, _Grow(policy)], max_steps=2, default_root_dir=str(tmp_path))
    assert policy.grown and finder.compressed_batch_size is not None
    assert model.batch_sizes_seen[-2:] == [finder.compressed_batch_size] * 2
    assert cb.stats.peak_live_bytes + cb.engine.budget_base <= parse_memory(BUDGET)


class WiderOnCalibrationSteps(FixedPolicy):
    """quant 2-bit, but 8-bit on its calibration steps (step 0): the first training step
    keeps about 3.7x what the search's trials (which run no calibration) kept."""

    name = "wider_on_calibration"

    def __init__(self) -> None:
        super().__init__(CodecSpec("quant", {"bits": 2}))
        self.wide = CodecSpec("quant", {"bits": 8}).build()
        self.calibrating = False

    def begin_step(self, step: int) -> None:
        self.calibrating = step == 0

    def needs_exact_gradient(self, step: int) -> bool:
        return step == 0

    def end_step(self, step: int, model: object, reduce: object = None) -> None:
        self.calibrating = False

    def codec_for(self, site, x):  # type: ignore[no-untyped-def]
        return self.wide if self.calibrating else self.codec


def test_the_first_step_is_played_ahead_and_the_size_halved_until_it_fits(
    tmp_path: Path,
) -> None:
    policy = WiderOnCalibrationSteps()
    finder = CompressedBatchSizeFinder(
        "power", steps_per_trial=1, max_val=4096, compare_uncompressed=False, headroom=0.0
    )
    cb = ActivationCompression(
        policy, scale_batch_size=finder, memory_budget=BUDGET, print_table=False
    )
    model = TinyCNN(batch_size=2, lr=0.01)
    fit(model, [cb], max_steps=2, default_root_dir=str(tmp_path))  # no MemoryBudgetError
    found = finder.compressed_batch_size
    assert found is not None and finder.first_step_halvings >= 1
    assert model.batch_sizes_seen[-2:] == [found, found]
    assert cb.stats.peak_live_bytes + cb.engine.budget_base <= parse_memory(BUDGET)
