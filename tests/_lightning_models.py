"""Tiny LightningModules for the adapter tests (importable by spawned DDP workers)."""

from __future__ import annotations

import atexit
import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_acgc.codecs import CodecSpec
from lightning_acgc.policies import FixedPolicy


def saved_tensors_hooks_active() -> bool:
    """Whether a default saved-tensors hook is active on this thread: with none, autograd
    hands back the very tensor it saved."""
    x = torch.randn(64, 64)
    w = torch.randn(64, 64, requires_grad=True)
    y = x * w
    return y.grad_fn._saved_self is not x


def module_hook_count(module: nn.Module) -> int:
    """Forward (pre-)hooks registered on ``module`` and its children."""
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._forward_hooks_always_called)
        for m in module.modules()
    )


class ProbePolicy(FixedPolicy):
    """A fixed codec that records the adapter's calls and compares the exact gradient it
    is handed with the gradient in ``p.grad`` at ``end_step``."""

    name = "probe"

    def __init__(self, config: CodecSpec, exact_every: int = 2) -> None:
        super().__init__(config)
        self.exact_every = exact_every
        self.calls: list[tuple[str, Any]] = []
        self.exact: dict[str, torch.Tensor] | None = None
        self.max_diff: list[float] = []
        self.step_diff: list[float] = []  # accumulated steps: step gradients vs exact

    def setup(self, model: nn.Module) -> None:
        self.calls.append(("setup", type(model).__name__))

    def begin_step(self, step: int) -> None:
        self.calls.append(("begin", step))
        self.exact = None

    def needs_exact_gradient(self, step: int) -> bool:
        return step % self.exact_every == 0

    def set_exact_gradients(self, grads: dict[str, torch.Tensor], reduce: Any = None) -> None:
        self.calls.append(("exact", len(grads)))
        self.exact = {k: g.clone() for k, g in grads.items()}

    def set_step_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        self.calls.append(("step gradients", len(grads)))
        assert self.exact is not None
        self.step_diff.append(max((g - self.exact[n]).abs().max().item() for n, g in grads.items()))

    def end_step(self, step: int, model: nn.Module, reduce: Any) -> None:
        self.calls.append(("end", step))
        if self.exact is not None:
            diff = max(
                (p.grad - self.exact[n]).abs().max().item()
                for n, p in model.named_parameters()
                if p.grad is not None
            )
            self.max_diff.append(diff)

    def metrics(self) -> dict[str, float]:
        return {"probe": 1.5}

    def state_dict(self) -> dict[str, Any]:
        return {"calls": len(self.calls)}

    def teardown(self) -> None:
        self.calls.append(("teardown", None))


def trainer_kwargs(**overrides: object) -> dict:
    """Quiet, fast, CPU Trainer arguments."""
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        max_epochs=1,
        deterministic=True,
    )
    kwargs.update(overrides)
    return kwargs


def fit(model: LightningModule, callbacks: list | None = None, **overrides: object) -> Trainer:
    trainer = Trainer(callbacks=callbacks or [], **trainer_kwargs(**overrides))
    trainer.fit(model)
    return trainer


class TinyMLP(LightningModule):
    """Linear-ReLU-(Dropout)-(BatchNorm)-Linear on fixed random data (no global RNG)."""

    def __init__(
        self,
        hidden: int = 256,
        batch_size: int = 16,
        samples: int = 64,
        dropout: float = 0.0,
        batchnorm: bool = False,
        raise_at_step: int | None = None,
        probe_validation: bool = False,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(32, hidden)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(hidden))
        layers.append(nn.ReLU())
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(hidden, 4))
        self.net = nn.Sequential(*layers)
        self.batch_size = batch_size
        self.raise_at_step = raise_at_step
        self.probe_validation = probe_validation
        self.validation_saw_hooks: list[bool] = []
        g = torch.Generator().manual_seed(1234)
        self._x = torch.randn(samples, 32, generator=g)
        self._y = torch.randint(0, 4, (samples,), generator=g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.raise_at_step is not None and self.global_step >= self.raise_at_step:
            raise RuntimeError("boom: raised mid-training on purpose")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        if self.probe_validation:
            with torch.enable_grad():
                self.validation_saw_hooks.append(saved_tensors_hooks_active())
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def _loader(self) -> DataLoader:
        return DataLoader(TensorDataset(self._x, self._y), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ManualTwoForward(TinyMLP):
    """Manual optimization with two forwards per step, one backward through both."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        half = x.shape[0] // 2
        loss = F.cross_entropy(self(x[:half]), y[:half]) + F.cross_entropy(self(x[half:]), y[half:])
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)


class TinyCNN(LightningModule):
    """A small CNN without max-pooling (its int64 indices would stay uncompressed)."""

    def __init__(self, batch_size: int = 2, samples: int = 2048, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        )
        self.batch_size = batch_size
        self.lr = lr
        self.batch_sizes_seen: list[int] = []
        g = torch.Generator().manual_seed(4321)
        self._x = torch.randn(samples, 3, 16, 16, generator=g)
        self._y = torch.randint(0, 10, (samples,), generator=g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        self.batch_sizes_seen.append(x.shape[0])
        return F.cross_entropy(self(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self._x, self._y), batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class RankRecorder(Callback):
    """Writes what each rank saw at train end to ``out_dir/rank<k>.json``: the settings
    digest of its ActivationCompression, the digests of all ranks, and a weight checksum."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.hooks_in_step: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.hooks_in_step.append(saved_tensors_hooks_active())

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning leaves a spawned worker's gloo process group alive until the
        # interpreter's last C++ destructors, where its threads can still be joinable: one
        # slow-suite run in about ten here aborted there, after fit had finished
        # ("terminate called without an active exception"). Destroy it as Python exits.
        if torch.distributed.is_initialized():
            atexit.register(_destroy_process_group)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_acgc.lightning.callback import ActivationCompression

        (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationCompression)]
        digest = torch.tensor([cb.settings_digest()], dtype=torch.int64)
        checksum = torch.tensor(
            [sum(p.detach().double().sum().item() for p in pl_module.parameters())],
            dtype=torch.float64,
        )
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "digest": int(digest.item()),
            "digests": trainer.strategy.all_gather(digest).reshape(-1).tolist(),
            "checksums": trainer.strategy.all_gather(checksum).reshape(-1).tolist(),
            "settings": sorted(
                (k, r.codec, r.settings) for k, r in cb.stats.sites.items() if r.codec != "kept"
            ),
            "tensors_packed": cb.stats.tensors_packed,
            "ratio": cb.stats.ratio,
            "policy_settings": cb.policy.site_settings(),
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "global_step": trainer.global_step,
            "hooks_after_step": any(self.hooks_in_step),
        }
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)
