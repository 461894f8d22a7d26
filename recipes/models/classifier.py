"""``Classifier``: the training loop shared by every recipe (loss, accuracy, optimizer)."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch.nn import functional as F
from torchmetrics.functional.classification import multiclass_accuracy

__all__ = ["Classifier"]

OPTIMIZERS = ("adamw", "sgd")
SCHEDULERS = ("cosine", "none")


class Classifier(pl.LightningModule):
    """Cross-entropy classification with per-epoch ``train/*`` and ``val/*`` metrics.

    Subclasses build the network and implement :meth:`logits_and_targets`. Logged per
    epoch: ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc`` (micro accuracy,
    ``torchmetrics``, averaged over the epoch's samples).

    Args:
        num_classes: number of classes.
        optimizer: ``"adamw"`` or ``"sgd"`` (with Nesterov momentum).
        lr: peak learning rate.
        weight_decay: decoupled weight decay (AdamW) or L2 penalty (SGD).
        momentum: SGD momentum (ignored by AdamW).
        scheduler: ``"cosine"`` (per-step cosine decay to 0 over the whole fit) or
            ``"none"`` (constant learning rate).

    Raises:
        ValueError: a bad optimizer, scheduler, ``num_classes`` or learning rate.
    """

    def __init__(
        self,
        num_classes: int,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        scheduler: str = "cosine",
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is unknown; allowed values: {OPTIMIZERS}")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={scheduler!r} is unknown; allowed values: {SCHEDULERS}")
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} must be >= 2")
        if not lr > 0:
            raise ValueError(f"lr={lr!r} must be > 0")
        self.num_classes = num_classes
        self.optimizer_name = optimizer
        self.lr = lr
        self.weight_decay = weight_decay
        self.momentum = momentum
        self.scheduler_name = scheduler

    def logits_and_targets(self, batch: Any, stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Class logits ``(n, num_classes)`` and integer targets ``(n,)`` of a batch.

        Args:
            batch: what the data module's loader yields.
            stage: ``"train"`` or ``"val"`` (graph recipes pick the node mask by it).
        """
        raise NotImplementedError

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        logits, targets = self.logits_and_targets(batch, stage)
        loss = F.cross_entropy(logits, targets)
        # Stateless on purpose: the epoch value is the batch-size weighted mean of what
        # was logged (exact micro accuracy), and a training_step that a callback runs
        # again with logging off (ActivationCompression's exact-gradient pass) counts once.
        acc = multiclass_accuracy(logits.detach(), targets, self.num_classes, average="micro")
        n = targets.shape[0]
        self.log(f"{stage}/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=n)
        self.log(f"{stage}/acc", acc, on_step=False, on_epoch=True, prog_bar=True, batch_size=n)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def _param_groups(self) -> list[dict[str, Any]]:
        """Weight decay on weights of rank >= 2 only (not on biases and norm scales)."""
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The recipe's optimizer over this model's parameters, without its schedule
        (AdamW, or SGD with Nesterov momentum); ``configure_optimizers`` adds the schedule.
        """
        groups = self._param_groups()
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(groups, lr=self.lr)
        return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, nesterov=True)

    def configure_optimizers(self) -> Any:
        opt = self.build_optimizer()
        steps = self.trainer.estimated_stepping_batches
        if self.scheduler_name == "none" or not math.isfinite(steps) or steps < 1:
            return opt
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=int(steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
