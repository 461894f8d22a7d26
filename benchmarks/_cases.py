"""The models the memory and speed benchmarks run: small ones for ``--quick``, the size
presets of ``configs/model/`` (published dimensions) for full mode.

A case is a family (``resnet``, ``bert``, ``gnn``, ``lm``: which blocks checkpointing wraps), the
Hydra overrides that compose it, and its batch: the recipe's data where that is cheap at
this size, or a generated batch of the preset's input size (ImageNet-size images).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch_geometric.data import Data

from benchmarks._machine import add_common_arguments

__all__ = [
    "CASES",
    "DEFAULT_CASES",
    "FAMILIES",
    "LM_CASES",
    "SPEED_CASES",
    "Case",
    "cases_parser",
    "generated_batch",
    "pick_cases",
    "sparse_adjacency",
]

FAMILIES = ("resnet", "bert", "gnn", "lm")

# A generated graph at ogbn-arxiv scale: 169,343 nodes, ~1.18M undirected edges (2.37M
# directed), 128 features, 40 classes; the SBM generator of the GNN recipe.
ARXIV = (
    "data.num_nodes=169343",
    "data.num_features=128",
    "data.num_classes=40",
    "data.avg_degree=14",
)

# BERT's vocabulary (30,522 word pieces: its embedding table is part of the weights the
# process holds), sequences of 128 tokens; the text recipe's generated task
TEXT = ("data.seq_len=128", "data.vocab_size=30522", "data.num_samples=256")

# The causal LMs read Python's documentation text (the char-LM recipe's data: a vocabulary
# of 128 characters), 256 characters per sequence
PYTEXT = ("data.seq_len=256",)


@dataclass(frozen=True)
class Case:
    """One benchmarked model.

    Args:
        family: ``resnet``, ``bert``, ``gnn`` or ``lm`` (a Hugging Face causal LM).
        overrides: Hydra overrides of the recipe's config.
        batch_size: samples per step (``None``: the whole graph).
        image_size: side of generated images (``None``: the recipe's data).
        sparse_adjacency: pass the graph's edges as a sparse CSR adjacency matrix
            (``adj_t``), so that message passing runs as one sparse-dense product
            instead of a gather and a scatter over every edge (how full-batch
            ogbn-arxiv models are trained; about 2x faster here at that scale).
    """

    family: str
    overrides: tuple[str, ...]
    batch_size: int | None = None
    image_size: int | None = None
    sparse_adjacency: bool = False

    def with_batch_size(self, batch_size: int | None) -> Case:
        """The same case with another batch size (``None``: unchanged)."""
        if batch_size is None or self.batch_size is None:
            return self
        return dataclasses.replace(self, batch_size=batch_size)

    def compose_overrides(self) -> list[str]:
        out = list(self.overrides)
        if self.batch_size is not None:
            out.append(f"data.batch_size={self.batch_size}")
        return out


# Full-mode batch sizes fit the whole full suite in about 45 minutes on 2 CPU cores
# (one plain step of each case takes a few seconds there); on a GPU pass
# --batch-size to measure at training batch sizes.
CASES: dict[str, dict[str, Case]] = {
    "quick": {
        "resnet": Case("resnet", ("model=resnet", "model.width=0.125"), 32),
        "bert": Case("bert", ("model=bert", "data.num_samples=512"), 32),
        "gnn": Case("gnn", ("model=gnn", "data.num_nodes=2000")),
        "gpt2": Case("lm", ("model=causal_lm", "model.arch=gpt2", "data.seq_len=64"), 16),
        "llama": Case("lm", ("model=causal_lm", "model.num_kv_heads=2", "data.seq_len=64"), 16),
    },
    "full": {
        # full width, CIFAR stem, batch 64: the size issue 14's step-time bar names
        "resnet18": Case("resnet", ("model=resnet18", "data.in_channels=3"), 64),
        "resnet18_imagenet": Case(
            "resnet", ("model=resnet18_imagenet", "data.in_channels=3"), 8, 224
        ),
        "resnet50": Case("resnet", ("model=resnet50", "data.in_channels=3"), 16),
        "resnet50_imagenet": Case(
            "resnet", ("model=resnet50_imagenet", "data.in_channels=3"), 4, 224
        ),
        "bert_base": Case("bert", ("model=bert_base", *TEXT), 4),
        "bert_small": Case("bert", ("model=bert_small", *TEXT), 16),
        "bert_mini": Case("bert", ("model=bert_mini", *TEXT), 32),
        "gcn_256": Case("gnn", ("model=gcn_256", *ARXIV), sparse_adjacency=True),
        "sage_256": Case("gnn", ("model=sage_256", *ARXIV), sparse_adjacency=True),
        "gat_256": Case("gnn", ("model=gat_256", *ARXIV)),
        "gpt2_small": Case("lm", ("model=gpt2_small", *PYTEXT), 4),
        "llama_135m": Case("lm", ("model=llama_135m", *PYTEXT), 4),
    },
}

# What ``run_all --full`` measures: one case per family (the others: --models).
DEFAULT_CASES = {
    "quick": ("resnet", "bert", "gnn"),
    "full": ("resnet50_imagenet", "bert_base", "gcn_256"),
}

# What the causal-LM benchmark (``benchmarks/causal_lm.py``) measures by default.
LM_CASES = {"quick": ("gpt2", "llama"), "full": ("gpt2_small", "llama_135m")}

# What the speed benchmark measures by default: the same, and in full mode also ResNet-18
# at full width with a training batch of 64 (a plain step takes about 1 s on 2 cores),
# where the codecs' per-call overhead no longer dominates as at ResNet-50's batch of 4.
SPEED_CASES = {"quick": DEFAULT_CASES["quick"], "full": ("resnet18", *DEFAULT_CASES["full"])}


def cases_parser(doc: str, default: str) -> argparse.ArgumentParser:
    """A benchmark's command line: the common options (``--quick``, ``--device``,
    ``--threads``) and ``--models`` (cases of ``CASES``; ``default`` says which run
    without it), described by the benchmark's docstring ``doc``."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser)
    parser.add_argument("--models", nargs="+", help=f"cases of _cases.CASES; default: {default}")
    return parser


def pick_cases(
    parser: argparse.ArgumentParser, names: Sequence[str] | None, mode: str, defaults: dict
) -> list[str]:
    """The cases a benchmark's ``--models`` names (``defaults[mode]`` when none), each
    checked against ``CASES[mode]``: an unknown one is a parser error naming the known.

    Example:
        >>> pick_cases(argparse.ArgumentParser(), None, "full", SPEED_CASES)[0]
        'resnet18'
    """
    names = list(names or defaults[mode])
    unknown = sorted(set(names) - set(CASES[mode]))
    if unknown:
        parser.error(f"--models {unknown}: {mode} mode has {sorted(CASES[mode])}")
    return names


def generated_batch(
    case: Case, in_channels: int, num_classes: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images of the case's size and random labels (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    n, side = case.batch_size or 1, case.image_size or 32
    images = torch.randn(n, in_channels, side, side, generator=generator)
    labels = torch.randint(0, num_classes, (n,), generator=generator)
    return images, labels


def sparse_adjacency(graph: Data) -> Data:
    """The graph with ``edge_index`` replaced by the transposed adjacency matrix in
    sparse CSR layout (row = target node), which torch_geometric's convolutions take.
    The same model for graphs without self-loops (the SBM graphs have none): on a sparse
    adjacency GCN adds its self-loops without first dropping existing ones."""
    from torch_geometric.utils import to_torch_csr_tensor

    n = graph.num_nodes
    graph = graph.clone()
    graph.edge_index = to_torch_csr_tensor(graph.edge_index.flip(0), size=(n, n))
    return graph
