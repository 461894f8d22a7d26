"""Models plain training handles fit with compression too: a sparse embedding's gradient
(which acgc's calibration compares element by element), an EmbeddingBag, complex FFT
outputs, tied weights, a weight-norm parametrization, frozen layers, a ``no_grad``
block, a Transformer encoder, a ``training_step`` that skips batches, a gradient penalty
(a double backward) and an LSTM."""

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


class GradientPenalty(Classifier):
    """A loss with the input gradient's norm in it (WGAN-GP's penalty): its backward
    saves tensors of its own (``create_graph=True``) and runs twice through the net."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        x = x.requires_grad_(True)
        out = self.net(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = F.cross_entropy(out, y) + 0.1 * (g.norm(dim=1) - 1).pow(2).mean()
        self.log("train_loss", loss)
        return loss


def test_acgc_fits_a_gradient_penalty() -> None:
    """Plain training of it works; so does acgc's, and its error model reads it."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2)
    )
    cb = ActivationCompression(calibrate_every=2, print_table=False)
    trainer = fit(GradientPenalty(net), [cb], max_steps=4)
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    assert float(trainer.callback_metrics["acgc/grad_error"]) <= 0.05
    # the output gradients are read from the loss's backward alone: the model holds
    # (κ near 1; counting the penalty's own backward too it fell 2x per calibration
    # and every tensor stayed at 16 bits)
    assert 0.25 < cb.policy.kappa < 4
    assert float(trainer.callback_metrics["acgc/avg_bits"]) < 12


class LastState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(32, 128, num_layers=2, batch_first=True), nn.Linear(128, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def _sequences() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 12, 32, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0, 0] > 0).long()), batch_size=32)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")
def test_an_lstm_compresses_with_the_library_kernel_off() -> None:
    """On CPU ``nn.LSTM`` runs through oneDNN, which saves its gates in an opaque uint8
    workspace per layer (most of the LSTM's saved bytes): kept as it is, the ratio stays
    near 1. With oneDNN off (the README's advice) PyTorch runs it op by op, saving gates
    and states per time step, which acgc compresses."""
    ratios = {}
    for library in (True, False):
        torch.manual_seed(0)
        cb = ActivationCompression(print_table=False)
        with torch.backends.mkldnn.flags(enabled=library):
            fit(Classifier(LastState(), data=_sequences), [cb], max_steps=4)
        ratios[library] = cb.stats.ratio
    assert ratios[True] < 1.3
    assert ratios[False] > 2.0


class CausalLM(LightningModule):
    """A Hugging Face causal LM (random init) on random tokens."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (x,) = batch
        return self.net(input_ids=x, labels=x).loss

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randint(0, 100, (64, 32), generator=g)), batch_size=16
        )

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _gpt2() -> nn.Module:
    """A two-layer GPT-2 (its dense layers are ``Conv1D``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=2,
        attn_implementation="eager",
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    """A two-layer Llama (LlamaRMSNorm, rotary positions, SiLU MLP)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_acgc_models_gpt2_s_dense_layers() -> None:
    """GPT-2's dense layers are Hugging Face ``Conv1D`` modules, not ``nn.Linear``: read
    as weight ops (their saved input charged fan_in·‖δ‖²), not by the heuristic other-ops
    factor, under which the attention output was kept whole."""
    torch.manual_seed(0)
    cb = ActivationCompression(calibrate_every=2, print_table=False)
    trainer = fit(CausalLM(_gpt2()), [cb], max_steps=6)
    assert float(trainer.callback_metrics["acgc/layer_grad_error"]) <= 0.05
    for key, record in cb.stats.sites.items():
        if key.endswith("c_proj:0"):  # the attention's output, the MLP's activation
            assert record.codec != "kept", key
    # the query, key and value, the last two through cat([empty KV cache, k]) (the cache
    # is on by default): remade from c_attn's input (layout_chain.py)
    for i in range(2):
        attention = [
            r for k, r in cb.stats.sites.items() if k.startswith(f"net.transformer.h.{i}.attn:")
        ]
        assert sum(r.settings.startswith("linear of") for r in attention) == 3
        # the eager attention's probabilities: remade from q and k (derive_softmax)
        assert sum(r.settings.startswith("softmax of") for r in attention) == 1
    # GPT-2's NewGELUActivation, op by op: the tanh, 0.5·x and 1 + tanh it saves and its
    # output (the MLP's c_proj input) remade by running it again (engine/replay.py)
    remade = [k for k, r in cb.stats.sites.items() if "NewGELUActivation run again" in r.settings]
    assert sorted(remade) == sorted(
        f"net.transformer.h.{i}.{site}"
        for i in range(2)
        for site in ("mlp.act:1", "mlp.act:2", "mlp.act:3", "mlp.c_proj:0")
    )


def test_acgc_reads_another_library_s_rms_norm_as_a_norm() -> None:
    """LlamaRMSNorm is no nn.RMSNorm but normalizes as one: its 1/rms per row is a norm
    statistic (kept as it is, for every policy), its input's error counts relative to
    the input's spread. Read as any op, κ ran to 33 and the widths to 13 bits a value."""
    torch.manual_seed(0)
    cb = ActivationCompression(calibrate_every=2, print_table=False)
    trainer = fit(CausalLM(_llama()), [cb], max_steps=6)
    statistics = [r for r in cb.stats.sites.values() if r.module_type == "LlamaRMSNorm"]
    statistics = [r for r in statistics if r.shape[-1] == 1 and not r.shared_with]
    assert statistics and all(r.settings == "norm statistic" for r in statistics)
    assert float(trainer.callback_metrics["acgc/layer_grad_error"]) <= 0.05
    assert 0.1 < cb.policy.kappa < 4
    # the norm written out: its normalized input and its output (the q, k, v projections'
    # and the MLP's input) remade by running it again (engine/replay.py)
    remade = {k for k, r in cb.stats.sites.items() if "LlamaRMSNorm run again" in r.settings}
    for i in range(2):
        layer = f"net.model.layers.{i}"
        assert {f"{layer}.self_attn.q_proj:0", f"{layer}.mlp.gate_proj:0"} <= remade
        # SwiGLU's product silu(gate)·up, saved by down_proj: made of its factors
        down = cb.stats.sites[f"{layer}.mlp.down_proj:0"]
        assert down.codec == "recomputed" and down.settings.startswith("product of")
        # the probabilities saved by softmax and, as a view, by p·v: packed once
        views = [r for k, r in cb.stats.sites.items() if k.startswith(f"{layer}.self_attn:")]
        assert any(r.settings.startswith("view of") for r in views)
        # the rotated query and key, saved by q·kᵀ: remade from q_proj's and k_proj's
        # input and the rotation's tables (derive_rotary)
        assert sum(r.settings.startswith("rotary of linear") for r in views) == 2
        # and the probabilities remade from those (derive_softmax), their view with them
        assert sum(r.settings.startswith("softmax of") for r in views) == 1
