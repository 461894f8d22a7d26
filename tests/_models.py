"""Four small architectures of different kinds, with inputs, for gradient tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class ResidualCNN(nn.Module):
    """Conv + BatchNorm + ReLU stem, two residual blocks, global pool, linear head."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.blocks = nn.ModuleList([self._block(width) for _ in range(2)])
        self.head = nn.Linear(width, classes)

    @staticmethod
    def _block(width: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = torch.relu(h + block(h))
        return self.head(h.mean(dim=(2, 3)))


class TransformerBlock(nn.Module):
    """Embedding, one encoder layer (attention, GELU MLP, LayerNorm, dropout), head."""

    def __init__(
        self, vocab: int = 64, dim: int = 64, heads: int = 4, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(
            dim,
            heads,
            dim_feedforward=4 * dim,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
        )
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(tokens)).mean(dim=1))


class MessagePassingGNN(nn.Module):
    """Two message-passing layers: mean of neighbour features via index_add_, then MLP."""

    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.lin1 = nn.Linear(2 * features, hidden)
        self.lin2 = nn.Linear(2 * hidden, classes)

    @staticmethod
    def _aggregate(h: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        out = torch.zeros_like(h).index_add_(0, dst, h[src])
        degree = torch.zeros(h.shape[0], device=h.device).index_add_(
            0, dst, torch.ones_like(dst, dtype=h.dtype)
        )
        return out / degree.clamp(min=1)[:, None]

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, edges = inputs
        h = torch.relu(self.lin1(torch.cat([x, self._aggregate(x, edges)], dim=1)))
        return self.lin2(torch.cat([h, self._aggregate(h, edges)], dim=1))


class GRUClassifier(nn.Module):
    """A GRU over a sequence of feature vectors, last state to a linear head."""

    def __init__(self, features: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def _graph(nodes: int = 600, edges: int = 3000) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(nodes, 32, generator=g), torch.randint(0, nodes, (2, edges), generator=g)


# name -> (model factory, input factory, loss)
ARCHITECTURES: dict[str, tuple[Callable[[], nn.Module], Callable[[], object]]] = {
    "cnn": (
        ResidualCNN,
        lambda: torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(1)),
    ),
    "transformer": (
        TransformerBlock,
        lambda: torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1)),
    ),
    "gnn": (MessagePassingGNN, _graph),
    "gru": (
        GRUClassifier,
        lambda: torch.randn(8, 24, 16, generator=torch.Generator().manual_seed(1)),
    ),
}


def loss_of(model: nn.Module, inputs: object) -> torch.Tensor:
    """A loss whose gradient reaches every parameter (fixed random targets)."""
    out = model(inputs)
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.device)
    return ((out - target) ** 2).mean()
