"""A zoo of small models trained a few steps under every policy: where plain training
has a finite loss and finite gradients, compressed training has them too, and nothing
raises. Each model stands for a pattern that once broke (a hand-written softmax's
amax, a GNN's max aggregation, a positive denominator under the division codec with
bf16 autocast) or that policies treat apart (RNN steps, complex FFT values, pooling
indices, channels_last, a gradient penalty through a second backward), or a layer type
the recipes do not use (checkpointed blocks, fused attention, 1-d and 3-d convolutions,
transposed convolutions, group and instance norms, pixel shuffles, LSTMs, tied
embeddings)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_acgc import ActivationCompressor, EngineSettings, build_policy, compressed_step


class HandSoftmaxAttention(nn.Module):
    def __init__(self, autocast: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 5)
        self.autocast = autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            scores = self.q(x) @ self.k(x).transpose(1, 2)
            p = (scores - scores.amax(-1, keepdim=True)).exp()
            p = p / p.sum(-1, keepdim=True)  # divides by a positive saved tensor
            return self.out((p @ x).mean(1)).float()


class MaxAggregation(nn.Module):
    """Messages scattered into 4 nodes by amax (GraphSAGE's max aggregation)."""

    def __init__(self) -> None:
        super().__init__()
        self.msg, self.out = nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = F.relu(self.msg(x))
        index = (torch.arange(x.shape[1]) % 4).view(1, -1, 1).expand_as(m)
        nodes = m.new_zeros(x.shape[0], 4, 32)
        nodes = nodes.scatter_reduce_(1, index, m, "amax", include_self=False)
        return self.out(nodes.mean(1))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.out = nn.GRU(32, 24, num_layers=2, batch_first=True), nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0][:, -1])


class Spectral(nn.Module):
    """Complex FFT values saved by ``abs`` and ``angle``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(32, 32), nn.Linear(17, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.fft.rfft(self.lin(x), dim=-1)
        return self.out(z.abs().mean(1) + z.angle().mean(1))


class Images(nn.Module):
    """channels_last conv, BatchNorm, max pooling with indices and a gather by them
    (max_unpool2d would do, but has no deterministic CPU kernel, which Lightning's
    ``deterministic=True`` in other tests leaves switched on)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1).to(memory_format=torch.channels_last)
        self.norm, self.out = nn.BatchNorm2d(8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm(self.conv(x.contiguous(memory_format=torch.channels_last))))
        pooled, index = F.max_pool2d(y, 2, return_indices=True)
        again = y.flatten(2).gather(2, index.flatten(2))  # the pooled values, by index
        return self.out((pooled.flatten(2) + again).amax(2))


class Half(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64).half(), nn.Linear(64, 5).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x.half()))).float().mean(1)


class Checkpointed(nn.Module):
    """Pre-norm residual blocks under torch.utils.checkpoint, reentrant or not. Not
    reentrant: the blocks' inputs saved through the hooks, every op inside through the
    checkpoint's own hooks. Reentrant: the model's input does not require grad, so the
    first block's output does not either and nothing of the blocks is saved or trained
    (torch warns; with an input that requires grad, reentrant checkpointing saves it
    through the hooks too: tests/test_checkpoint_inputs.py)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(32) for _ in range(2)])
        self.ups = nn.ModuleList([nn.Linear(32, 64) for _ in range(2)])
        self.downs = nn.ModuleList([nn.Linear(64, 32) for _ in range(2)])
        self.out, self.reentrant = nn.Linear(32, 5), reentrant

    def _block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x + self.downs[i](F.silu(self.ups[i](self.norms[i](x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(2):
            x = checkpoint(self._block, i, x, use_reentrant=self.reentrant)
        return self.out(x.mean(1))


class FusedAttention(nn.Module):
    """F.scaled_dot_product_attention (causal, with dropout) and a PyTorch encoder layer."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, norm_first=True)
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        return self.out(self.layer(self.proj(y.transpose(1, 2).reshape(x.shape))).mean(1))


class Signal(nn.Module):
    """Conv1d, GroupNorm, hardswish, InstanceNorm (affine, running stats), a transposed
    convolution and PReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.group = nn.Conv1d(32, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.instance = nn.InstanceNorm1d(8, affine=True, track_running_stats=True)
        self.up, self.act, self.out = (
            nn.ConvTranspose1d(8, 8, 4, stride=2),
            nn.PReLU(),
            nn.Linear(8, 5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.instance(F.hardswish(self.group(self.conv(x.transpose(1, 2)))))
        return self.out(self.act(self.up(y)).mean(-1))


class Volume(nn.Module):
    """Conv3d, BatchNorm3d, trilinear upsampling, Mish."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4)
        self.up, self.out = nn.Upsample(scale_factor=2, mode="trilinear"), nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.mish(self.up(self.norm(self.conv(x)))).mean((2, 3, 4)))


class Shuffle(nn.Module):
    """PixelShuffle, Dropout2d, an eval-mode BatchNorm, ELU and a global max pooling by
    amax; a frozen convolution in front."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Conv2d(3, 3, 1).requires_grad_(False)
        self.conv, self.shuffle = nn.Conv2d(3, 16, 3, padding=1), nn.PixelShuffle(2)
        self.drop, self.norm, self.out = (
            nn.Dropout2d(0.2),
            nn.BatchNorm2d(4).eval(),
            nn.Linear(4, 5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.drop(self.shuffle(self.conv(self.frozen(x)))))
        return self.out(F.elu(y).amax((2, 3)))


class Sequences(nn.Module):
    """A bidirectional LSTM and a tanh RNN side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 16, batch_first=True, bidirectional=True)
        self.rnn, self.out = nn.RNN(32, 8, batch_first=True), nn.Linear(40, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.lstm(x)[0][:, -1], self.rnn(x)[0][:, -1]], -1))


class TiedEmbedding(nn.Module):
    """An embedding read back as the output layer, an EmbeddingBag, a LayerNorm without
    affine parameters, log_softmax, softplus and cumsum."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.bag = nn.Embedding(50, 32), nn.EmbeddingBag(50, 32, mode="mean")
        self.norm = nn.LayerNorm(32, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 10).long().clamp(max=49)[..., 0]
        h = self.norm(self.embed(ids) + self.bag(ids).unsqueeze(1))
        h = torch.log_softmax(F.softplus(h), -1).cumsum(1)
        return (h @ self.embed.weight.t()).mean(1)[:, :5]


def _penalty(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss plus the squared gradient of the loss by the input (create_graph)."""
    x = x.clone().requires_grad_(True)
    loss = F.cross_entropy(model(x), y)
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    return loss + grad.square().sum()


SEQUENCE = (8, 16, 32)
ZOO: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], bool]] = {
    "hand_softmax": (HandSoftmaxAttention, SEQUENCE, False),
    "hand_softmax_bf16": (lambda: HandSoftmaxAttention(autocast=True), SEQUENCE, False),
    "max_aggregation": (MaxAggregation, SEQUENCE, False),
    "gru": (Recurrent, SEQUENCE, False),
    "fft": (Spectral, SEQUENCE, False),
    "images": (Images, (8, 3, 16, 16), False),
    "float16": (Half, SEQUENCE, False),
    "gradient_penalty": (Recurrent, SEQUENCE, True),
    "checkpoint_reentrant": (lambda: Checkpointed(reentrant=True), SEQUENCE, False),
    "checkpoint": (lambda: Checkpointed(reentrant=False), SEQUENCE, False),
    "fused_attention": (FusedAttention, SEQUENCE, False),
    "signal": (Signal, SEQUENCE, False),
    "volume": (Volume, (4, 2, 6, 6, 6), False),
    "shuffle": (Shuffle, (4, 3, 8, 8), False),
    "sequences": (Sequences, SEQUENCE, False),
    "tied_embedding": (TiedEmbedding, SEQUENCE, False),
}
POLICIES = {
    "acgc": {},
    "acgc_bounded": {"codec": "bounded"},
    "gact": {},
    "division": {},
    "comet": {},
    "fixed": {"codec": "quant", "bits": 2},
}


def _finite(model: nn.Module, loss: torch.Tensor) -> bool:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return bool(torch.isfinite(loss)) and all(bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_compressed_training_is_finite_where_plain_is(name: str, policy: str) -> None:
    make, shape, penalty = ZOO[name]
    torch.manual_seed(0)
    model, x, y = make(), torch.randn(*shape), torch.randint(0, 5, (shape[0],))
    loss_of = (lambda: _penalty(model, x, y)) if penalty else (lambda: F.cross_entropy(model(x), y))
    plain = loss_of()
    plain.backward()
    assert _finite(model, plain)  # the zoo's own check: each model trains plainly
    built = build_policy(policy.removesuffix("_bounded"), **POLICIES[policy])
    engine = ActivationCompressor(built, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    built.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        for step in range(4):  # calibration steps, then ordinary ones
            optimizer.zero_grad()
            loss = compressed_step(engine, model, loss_of, step)
            assert _finite(model, loss), step
            optimizer.step()
    finally:
        engine.remove()
        built.teardown()
