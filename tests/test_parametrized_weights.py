"""Weights computed by a parametrization (``weight_norm``, ``spectral_norm``) are the
weights the ops use, not activations: the engine keeps them and what the parametrization
saves as they are (lightning_acgc.engine.param_weights), and acgc reads the gradients of
their originals as the weight op's (policies._acgc_stats.module_of)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_acgc import ActivationCompression, ActivationCompressor, compressed_step
from lightning_acgc.policies import build_policy
from tests._lightning_models import fit


def _stack(norm: bool) -> nn.Sequential:
    wrap = nn.utils.parametrizations.weight_norm if norm else (lambda m: m)
    layers: list[nn.Module] = []
    for i in range(3):
        layers += [wrap(nn.Conv1d(1 if i == 0 else 32, 32, 7, padding=3)), nn.LeakyReLU(0.1)]
    return nn.Sequential(*layers, wrap(nn.Conv1d(32, 1, 7, padding=3)))


def test_computed_weights_are_kept_as_they_are() -> None:
    model = _stack(norm=True)
    model[-1] = nn.utils.parametrizations.spectral_norm(nn.Conv1d(32, 1, 7, padding=3))
    engine = ActivationCompressor(build_policy("fixed", codec="quant", bits=2), model=model)
    engine.install()
    try:
        x = torch.randn(4, 1, 256)
        compressed_step(engine, model, lambda: model(x).square().mean(), step=0)
    finally:
        engine.remove()
    reasons = {k: r.settings for k, r in engine.stats.sites.items() if r.codec == "kept"}
    for i in (0, 2, 4, 6):  # each convolution's weight (its second saved tensor)
        assert reasons[f"{i}:1"] == "computed weight", i
    # what the parametrizations save (weight norm's norms, spectral norm's vectors)
    inside = [k for k in engine.stats.sites if ".parametrizations." in k]
    assert inside and all(k in reasons for k in inside)
    assert reasons["6.parametrizations.weight.0:0"] == "computed weight"  # (the rest: tiny)
    # the activations are compressed as ever
    assert engine.stats.sites["1:0"].codec != "kept"


class Regression(LightningModule):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.net = _stack(norm)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 1, 512, generator=g)
        return DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=16)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_acgc_compresses_a_weight_normed_stack_as_the_plain_one() -> None:
    """A weight-normed convolution stack (a vocoder's) was compressed 2-3 bits a value
    wider than the same stack without the parametrization: its weights were compressed
    (κ ran to 144, a layer over e) and the per-layer promise read each convolution's
    budget against its bias's gradient alone (the weight's gradient sits in the
    parametrization's originals)."""
    bits = {}
    for norm in (False, True):
        torch.manual_seed(0)
        cb = ActivationCompression(calibrate_every=2, print_table=False)
        trainer = fit(Regression(norm), [cb], max_steps=12, max_epochs=-1)
        logged = trainer.callback_metrics
        assert float(logged["acgc/layer_grad_error"]) <= 0.05
        bits[norm] = float(logged["acgc/avg_bits"])
    assert bits[True] <= bits[False] + 1.0
