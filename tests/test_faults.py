"""Failures in the middle of a compressed step: raised in ``training_step``, in a
module's forward, in a codec's encode, and a KeyboardInterrupt. Each leaves no hook
installed and no live saved bytes, and the next ``fit`` on the same Trainer and model
trains normally."""

from __future__ import annotations

import gc
import signal
from collections.abc import Callable

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_acgc import ActivationCompression
from lightning_acgc.codecs.quant import QuantCodec
from tests._lightning_models import (
    TinyMLP,
    module_hook_count,
    saved_tensors_hooks_active,
    trainer_kwargs,
)

STEPS = 6
FAULT_STEP = 2


class _Bomb(nn.Module):
    """Raises a fresh ``error`` in its forward when armed; otherwise the identity."""

    def __init__(self) -> None:
        super().__init__()
        self.error: type[BaseException] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.error is not None:
            raise self.error("boom in a module's forward")
        return x


class FaultyMLP(TinyMLP):
    """TinyMLP with a module between its hidden layers that can raise mid-forward."""

    def __init__(self) -> None:
        super().__init__(samples=64, batch_size=8)
        self.net.insert(2, _Bomb())
        self.fault: Callable[[FaultyMLP], None] | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        if self.fault is not None and self.global_step == FAULT_STEP:
            self.fault(self)
        return super().training_step(batch, batch_idx)


def _after_forward(model: FaultyMLP) -> None:
    """Run a compressed forward whose graph the exception's frames keep alive, then raise."""
    x, _ = next(iter(model.train_dataloader()))
    held = model(x).sum()  # noqa: F841 - kept alive by this frame
    raise RuntimeError("boom in training_step")


def _in_module(model: FaultyMLP) -> None:
    model.net[2].error = RuntimeError


def _keyboard(model: FaultyMLP) -> None:
    model.net[2].error = KeyboardInterrupt


FAULTS: dict[str, tuple[Callable[[FaultyMLP], None], type[BaseException]]] = {
    "training_step": (_after_forward, RuntimeError),
    "module_forward": (_in_module, RuntimeError),
    "keyboard_interrupt": (_keyboard, SystemExit),  # Lightning turns it into sys.exit(1)
}


def _assert_clean(model: FaultyMLP, cb: ActivationCompression) -> None:
    assert module_hook_count(model) == 0
    assert not saved_tensors_hooks_active()
    assert cb.engine is not None and not cb.engine.installed
    strategy = model.trainer.strategy
    assert "training_step" not in vars(strategy)  # the per-instance wrapper is gone
    gc.collect()
    assert cb.engine.stats.live_bytes == 0


def _refit(trainer: Trainer, model: FaultyMLP, cb: ActivationCompression) -> None:
    model.fault = None
    model.net[2].error = None
    trainer.fit(model)
    assert trainer.global_step == STEPS
    assert trainer.state.finished
    assert float(trainer.callback_metrics["acgc/ratio"]) > 1
    _assert_clean(model, cb)


@pytest.mark.parametrize("where", sorted(FAULTS))
def test_fault_mid_step_leaves_nothing_and_refit_works(where: str) -> None:
    fault, raised = FAULTS[where]
    model = FaultyMLP()
    model.fault = fault
    cb = ActivationCompression(codec="quant", bits=4, min_numel=0, print_table=False)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(max_steps=STEPS, max_epochs=-1))
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(raised):
            trainer.fit(model)
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores SIGINT after an interrupt
    assert trainer.global_step == FAULT_STEP
    _assert_clean(model, cb)
    _refit(trainer, model, cb)


def test_codec_failure_mid_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A codec that raises (``strict=True`` re-raises codec errors) mid-forward, after
    the step saved its first tensors."""
    model = FaultyMLP()
    cb = ActivationCompression(codec="quant", bits=4, min_numel=0, print_table=False, strict=True)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(max_steps=STEPS, max_epochs=-1))
    encode = QuantCodec.encode_deferred  # what the engine calls
    calls = {"n": 0}

    def failing(self: QuantCodec, x: torch.Tensor, seed: int):  # type: ignore[no-untyped-def]
        if model.global_step == FAULT_STEP:
            calls["n"] += 1
            if calls["n"] == 1:  # the ReLU's output, after the batch was saved as it is
                raise RuntimeError("boom in encode")
        return encode(self, x, seed)

    monkeypatch.setattr(QuantCodec, "encode_deferred", failing)
    with pytest.raises(RuntimeError, match="boom in encode"):
        trainer.fit(model)
    assert trainer.global_step == FAULT_STEP
    _assert_clean(model, cb)
    monkeypatch.setattr(QuantCodec, "encode_deferred", encode)
    _refit(trainer, model, cb)
