"""Coverage: how much of what autograd saves the fixed 2-bit codec reaches, per model.

Runs one forward/backward of four small models under
``compress_activations(codec="quant", bits=2, ...)`` and prints the per-site table of each
(where the remaining bytes are), then one JSON line with each model's ratio (bytes saved
by autograd / bytes kept) next to its goal:

* ``unet``: a U-Net-like CNN with MaxPool (int64 pooling indices), goal >= 12x;
* ``gnn``: the GNN recipe's GCN on the generated SBM graph (``edge_index`` in every
  layer), goal >= 8x;
* ``gru``: a 2-layer GRU with per-step tensors of a few hundred elements, goal >= 4x;
* ``embbag``: an EmbeddingBag model (token indices and offsets), goal >= 4x.

The loss's own tensors (saved outside the model) are stored as float16, as the engine does
by default; ``--compress-loss`` gives them the policy's codec too (the U-Net's per-pixel
log-probabilities: 0.25 MB raw, 0.125 MB as float16, of its 1.6 MB after compression).

    python -m benchmarks.coverage [--min-numel 1024] [--meta fp32|bf16] [--compress-loss]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from torch import nn

from lightning_acgc import compress_activations

GOALS = {"unet": 12.0, "gnn": 8.0, "gru": 4.0, "embbag": 4.0}


class _Block(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.ReLU(),
        )


class UNet(nn.Module):
    """Two-level U-Net: conv blocks, MaxPool down, transposed conv up, skip concat."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.down1, self.down2 = _Block(3, width), _Block(width, 2 * width)
        self.pool = nn.MaxPool2d(2)
        self.mid = _Block(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = _Block(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = _Block(2 * width, width)
        self.head = nn.Conv2d(width, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(self.pool(d1))
        m = self.mid(self.pool(d2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], 1))
        return self.head(self.dec1(torch.cat([self.up1(u2), d1], 1)))


class GRUModel(nn.Module):
    """A 2-layer GRU (hidden 48, batch 8: 384 elements per step) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(32, 48, num_layers=2, batch_first=True)
        self.head = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class BagModel(nn.Module):
    """EmbeddingBag (mean of each bag's token vectors) then an MLP."""

    def __init__(self, vocab: int = 20_000, dim: int = 64) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 4))

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bag(tokens, offsets))


def _unet() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    x = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    return UNet(), lambda m: m(x).square().mean()


def _gnn() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    from recipes.data.graph import make_sbm_graph
    from recipes.models.gnn import GNNClassifier

    graph = make_sbm_graph(seed=0)
    model = GNNClassifier(num_classes=5, in_channels=graph.x.shape[1], arch="gcn")

    def loss(m: nn.Module) -> torch.Tensor:
        logits, y = m.logits_and_targets(graph, "train")
        return nn.functional.cross_entropy(logits, y)

    return model, loss


def _gru() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    x = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(0))
    return GRUModel(), lambda m: m(x).square().mean()


def _embbag() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 40, (512,), generator=g)
    tokens = torch.randint(0, 20_000, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return BagModel(), lambda m: m(tokens, offsets).square().mean()


MODELS = {"unet": _unet, "gnn": _gnn, "gru": _gru, "embbag": _embbag}


def measure(name: str, top: int = 8, **settings: object) -> tuple[float, str]:
    """(ratio, per-site table) of one forward/backward of model ``name``."""
    torch.manual_seed(0)
    model, loss = MODELS[name]()
    with compress_activations(codec="quant", bits=2, model=model, **settings) as stats:
        loss(model).backward()
    return stats.ratio, stats.table(top=top)  # the largest sites, the rest counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--min-numel", type=int, default=None)
    parser.add_argument("--meta", choices=["fp32", "bf16"], default=None)
    parser.add_argument("--only", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--compress-loss", action="store_true", help="the loss's tensors too")
    parser.add_argument("--quiet", action="store_true", help="no per-site tables")
    parser.add_argument("--top", type=int, default=8, help="sites shown of long tables")
    args = parser.parse_args()
    settings: dict[str, object] = {}
    if args.min_numel is not None:
        settings["min_numel"] = args.min_numel
    if args.meta is not None:
        settings["meta"] = args.meta
    if args.compress_loss:
        settings["compress_loss"] = True
    result: dict[str, object] = {"benchmark": "coverage", "codec": "quant bits=2", **settings}
    for name in args.only:
        ratio, table = measure(name, args.top, **settings)
        if not args.quiet:
            print(f"== {name}\n{table}\n")
        result[name] = {"ratio": round(ratio, 2), "goal": GOALS[name]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
