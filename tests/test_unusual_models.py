"""Models plain training handles fit with compression too: a sparse embedding's gradient
(which acgc's calibration compares element by element), an EmbeddingBag, complex FFT
outputs, tied weights, a weight-norm parametrization, frozen layers, a ``no_grad``
block, a Transformer encoder, and a ``training_step`` that skips batches."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_acgc import ActivationCompression
from lightning_acgc.policies import available_policies
from tests._lightning_models import fit


def _features() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


def _tokens() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 100, (64, 12), generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 50).long()), batch_size=16)


class Classifier(LightningModule):
    """``net`` trained by cross-entropy on ``data()``; ``skip_odd``: ``training_step``
    returns None on odd batches."""

    def __init__(
        self, net: nn.Module, data: Callable[[], DataLoader] = _features, skip_odd: bool = False
    ) -> None:
        super().__init__()
        self.net, self.data, self.skip_odd = net, data, skip_odd

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.skip_odd and batch_idx % 2:
            return None  # Lightning skips the step
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return self.data()


class MeanTokens(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(1)


class Spectrum(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = torch.fft.rfft(h, dim=-1)
        return torch.cat([z.real, z.imag], -1)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.mid = nn.Sequential(nn.Linear(64, 64), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.mid(self.emb(x)).mean(1) @ self.emb.weight.t())[:, :2]


class NoGradFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(32, 128), nn.Linear(128, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = F.relu(self.first(x))
        return self.last(h)


def _sparse() -> Classifier:
    net = nn.Sequential(
        nn.Embedding(100, 64, sparse=True), MeanTokens(), nn.Linear(64, 128), nn.ReLU(),
        nn.Linear(128, 2),
    )  # fmt: skip
    return Classifier(net, data=_tokens)


MODELS = {
    "sparse_embedding": _sparse,
    "embedding_bag": lambda: Classifier(
        nn.Sequential(nn.EmbeddingBag(100, 64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 2)),
        data=_tokens,
    ),
    "fft": lambda: Classifier(nn.Sequential(nn.Linear(32, 64), Spectrum(), nn.Linear(66, 2))),
    "tied": lambda: Classifier(Tied(), data=_tokens),
    "weight_norm": lambda: Classifier(
        nn.Sequential(
            nn.utils.parametrizations.weight_norm(nn.Linear(32, 128)), nn.SiLU(), nn.Linear(128, 2)
        )
    ),
    "frozen_first_layer": lambda: Classifier(
        nn.Sequential(
            nn.Linear(32, 128).requires_grad_(False),
            nn.ReLU(),
            nn.Linear(128, 128),
            nn.ReLU(),
            nn.Linear(128, 2),
        )
    ),
    "no_grad_block": lambda: Classifier(NoGradFirst()),
    "transformer": lambda: Classifier(
        nn.Sequential(
            nn.Embedding(100, 32),
            nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2),
            MeanTokens(),
            nn.Linear(32, 2),
        ),
        data=_tokens,
    ),
    "skipped_steps": lambda: Classifier(
        nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 2)), skip_odd=True
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_acgc_fits_and_calibrates(name: str) -> None:
    torch.manual_seed(0)
    cb = ActivationCompression(calibrate_every=2, print_table=False)
    trainer = fit(MODELS[name](), [cb], max_steps=4)
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    error = trainer.callback_metrics.get("acgc/grad_error")
    assert error is not None and math.isfinite(float(error))
    assert float(trainer.callback_metrics["acgc/ratio"]) > 1.5  # a skipped step: not 1.0


@pytest.mark.parametrize("policy", [p for p in available_policies() if p != "acgc"])
def test_every_policy_fits_a_sparse_embedding(policy: str) -> None:
    cb = ActivationCompression(policy=policy, print_table=False)
    trainer = fit(_sparse(), [cb], max_steps=3)
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
