"""Compression strategies: registry names, scoping of training_step, callback wiring."""

from __future__ import annotations

import pytest
import torch
from _lightning_models import (
    ManualTwoForward,
    TinyMLP,
    module_hook_count,
    saved_tensors_hooks_active,
    trainer_kwargs,
)
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry

from lightning_acgc.lightning.callback import ActivationCompression
from lightning_acgc.lightning.strategy import ACGCDDPStrategy, ACGCFSDPStrategy, ACGCStrategy


def _kwargs(**overrides: object) -> dict:
    kwargs = trainer_kwargs(**overrides)
    kwargs.pop("devices")
    return kwargs


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("acgc", ACGCStrategy),
        ("acgc_ddp", ACGCDDPStrategy),
        ("acgc_ddp_spawn", ACGCDDPStrategy),
        ("acgc_ddp_fork", ACGCDDPStrategy),
        ("acgc_fsdp", ACGCFSDPStrategy),
    ],
)
def test_registered_in_lightning(name: str, cls: type) -> None:
    assert name in StrategyRegistry
    assert type(StrategyRegistry.get(name)) is cls


def test_spawn_variant_uses_spawn() -> None:
    assert StrategyRegistry.get("acgc_ddp_spawn")._start_method == "spawn"


def test_single_device_takes_one_device_only() -> None:
    with pytest.raises(ValueError, match="runs on one device"):
        Trainer(strategy="acgc", accelerator="cpu", devices=2, logger=False)


def test_strategy_alone_adds_the_default_callback() -> None:
    model = TinyMLP()
    trainer = Trainer(strategy="acgc", **_kwargs(max_steps=2))
    trainer.fit(model)
    (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationCompression)]
    assert cb.describe() == ActivationCompression().describe()
    assert cb.stats.tensors_packed > 0
    assert trainer.callback_metrics["acgc/ratio"] > 1
    assert trainer.strategy._acgc_scope is None
    assert module_hook_count(model) == 0


def test_strategy_uses_the_given_compression() -> None:
    cb = ActivationCompression(codec="quant", bits=2, print_table=False)
    trainer = Trainer(strategy=ACGCStrategy(compression=cb), **_kwargs(max_steps=1))
    trainer.fit(TinyMLP())
    assert cb in trainer.callbacks
    assert cb.stats.sites["net.1:0"].settings.startswith("bits=2")


def test_strategy_with_callback_scopes_without_patching() -> None:
    cb = ActivationCompression(codec="quant", bits=2, print_table=False)
    strategy = ACGCStrategy()
    seen: list[bool] = []

    class Probe(TinyMLP):
        def training_step(self, batch, batch_idx):  # type: ignore[override]
            seen.append(saved_tensors_hooks_active())
            assert "training_step" not in self.trainer.strategy.__dict__
            return super().training_step(batch, batch_idx)

    model = Probe()
    trainer = Trainer(strategy=strategy, callbacks=[cb], **_kwargs(max_steps=2))
    trainer.fit(model)
    assert seen == [True, True]
    assert [c for c in trainer.callbacks if isinstance(c, ActivationCompression)] == [cb]
    assert strategy._acgc_scope is None and not saved_tensors_hooks_active()


def test_compression_given_twice_raises() -> None:
    strategy = ACGCStrategy(compression=ActivationCompression(bits=2))
    trainer = Trainer(strategy=strategy, callbacks=[ActivationCompression()], **_kwargs())
    with pytest.raises(ValueError, match="give it in one place"):
        trainer.fit(TinyMLP())


def test_manual_optimization_through_the_strategy() -> None:
    cb = ActivationCompression(codec="quant", bits=4, min_numel=0, print_table=False)
    trainer = Trainer(strategy="acgc", callbacks=[cb], **_kwargs(max_steps=2, max_epochs=3))
    trainer.fit(ManualTwoForward(batch_size=32))
    assert {"net.1:0", "net.1:1"} <= set(cb.stats.sites)


def test_stock_strategy_is_wrapped_on_the_instance_only() -> None:
    # A fixed codec: no calibration pass, so training_step runs once per step.
    cb = ActivationCompression(policy="fixed", print_table=False)
    strategy = SingleDeviceStrategy(device="cpu")
    other = SingleDeviceStrategy(device="cpu")
    inside: list[bool] = []

    class Probe(TinyMLP):
        def training_step(self, batch, batch_idx):  # type: ignore[override]
            inside.append("training_step" in self.trainer.strategy.__dict__)
            inside.append(saved_tensors_hooks_active())
            return super().training_step(batch, batch_idx)

    Trainer(strategy=strategy, callbacks=[cb], **_kwargs(max_steps=1)).fit(Probe())
    assert inside == [True, True]
    assert "training_step" not in strategy.__dict__
    assert SingleDeviceStrategy.training_step is not None and "training_step" not in other.__dict__


def test_exception_detaches_the_strategy() -> None:
    cb = ActivationCompression(print_table=False)
    strategy = ACGCStrategy()
    model = TinyMLP(raise_at_step=1)
    trainer = Trainer(strategy=strategy, callbacks=[cb], **_kwargs(max_epochs=1))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model)
    assert strategy._acgc_scope is None
    assert module_hook_count(model) == 0 and not saved_tensors_hooks_active()
    # without compression attached the strategy is plain Lightning
    x = torch.randn(4, 32)
    assert torch.equal(model(x), model(x))
