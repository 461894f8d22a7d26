"""Graph data for full-batch node classification: a generated stochastic block model
(offline default) and Planetoid Cora (``torch_geometric``).

Each training "batch" is the whole graph; an epoch makes ``steps_per_epoch`` steps.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from torch_geometric.data import Data
from torch_geometric.utils import coalesce

from recipes.data.availability import data_root, fall_back_or_raise, network_problem

__all__ = ["CoraDataModule", "SBMGraphDataModule", "make_sbm_graph"]


def make_sbm_graph(
    num_nodes: int = 10_000,
    num_classes: int = 5,
    num_features: int = 64,
    avg_degree: float = 10.0,
    homophily: float = 0.7,
    feature_signal: float = 0.15,
    train_fraction: float = 0.1,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> Data:
    """An undirected stochastic-block-model graph whose blocks are the node classes.

    Edges between blocks ``a`` and ``b`` are drawn independently with probability
    ``p_in`` (a = b) or ``p_out`` (a ≠ b), chosen so that the mean degree is
    ``avg_degree`` and a share ``homophily`` of a node's edges stay in its block.
    Features are the class's random centroid scaled by ``feature_signal`` plus unit
    Gaussian noise: on their own they classify poorly; averaged over neighbours (what
    a GNN learns to do) they classify well.

    Args:
        num_nodes: number of nodes (assigned to classes at random, in equal shares).
        num_classes: number of blocks, i.e. classes.
        num_features: feature size.
        avg_degree: expected mean degree.
        homophily: expected share of intra-block edges, in (0, 1].
        feature_signal: scale of the class centroids relative to the noise.
        train_fraction: share of nodes in ``train_mask``.
        val_fraction: share of nodes in ``val_mask`` (disjoint from training).
        seed: seed of everything random (the graph is a pure function of the arguments).

    Returns:
        ``Data(x, edge_index, y, train_mask, val_mask)``.

    Raises:
        ValueError: sizes or fractions out of range.

    Example:
        >>> g = make_sbm_graph(num_nodes=1000, num_classes=4, num_features=8, seed=0)
        >>> g.num_nodes, g.x.shape[1], bool(g.is_undirected())
        (1000, 8, True)
    """
    _check_sbm(num_nodes, num_classes, avg_degree, homophily, train_fraction, val_fraction)
    g = torch.Generator().manual_seed(seed)
    y = torch.randperm(num_nodes, generator=g) % num_classes  # balanced classes
    members = [torch.nonzero(y == c).flatten() for c in range(num_classes)]
    sizes = torch.tensor([len(m) for m in members], dtype=torch.float64)
    # expected edge ends: homophily * avg_degree per node inside its block, the rest outside
    pairs_in = (sizes * (sizes - 1) / 2).sum()
    pairs_out = (sizes.sum() ** 2 - (sizes**2).sum()) / 2
    p_in = homophily * avg_degree * num_nodes / 2 / pairs_in.clamp(min=1)
    p_out = (1 - homophily) * avg_degree * num_nodes / 2 / pairs_out.clamp(min=1)
    src, dst = [], []
    for a in range(num_classes):
        for b in range(a, num_classes):
            pairs = sizes[a] * (sizes[a] - 1) / 2 if a == b else sizes[a] * sizes[b]
            rate = (p_in if a == b else p_out) * pairs
            count = int(torch.poisson(rate.float().reshape(1), generator=g).item())
            src.append(members[a][torch.randint(len(members[a]), (count,), generator=g)])
            dst.append(members[b][torch.randint(len(members[b]), (count,), generator=g)])
    edges = torch.stack([torch.cat(src), torch.cat(dst)])
    edges = edges[:, edges[0] != edges[1]]  # no self-loops
    edge_index = coalesce(torch.cat([edges, edges.flip(0)], dim=1), num_nodes=num_nodes)
    centroids = torch.randn(num_classes, num_features, generator=g) * feature_signal
    x = centroids[y] + torch.randn(num_nodes, num_features, generator=g)
    perm = torch.randperm(num_nodes, generator=g)
    n_train, n_val = round(train_fraction * num_nodes), round(val_fraction * num_nodes)
    train_mask = torch.zeros(num_nodes, dtype=torch.bool)
    val_mask = torch.zeros(num_nodes, dtype=torch.bool)
    train_mask[perm[:n_train]] = True
    val_mask[perm[n_train : n_train + n_val]] = True
    return Data(x=x, edge_index=edge_index, y=y, train_mask=train_mask, val_mask=val_mask)


def _check_sbm(
    num_nodes: int,
    num_classes: int,
    avg_degree: float,
    homophily: float,
    train_fraction: float,
    val_fraction: float,
) -> None:
    if num_classes < 2 or num_nodes < 2 * num_classes:
        raise ValueError(
            f"num_classes={num_classes} must be >= 2 with at least 2 nodes per class "
            f"(num_nodes={num_nodes})"
        )
    if not 0 < homophily <= 1:
        raise ValueError(f"homophily={homophily!r} must be in (0, 1]")
    if not (train_fraction > 0 and val_fraction > 0 and train_fraction + val_fraction <= 1):
        raise ValueError(
            f"train_fraction={train_fraction!r} and val_fraction={val_fraction!r} must be > 0 "
            f"and sum to at most 1"
        )
    if avg_degree <= 0:
        raise ValueError(f"avg_degree={avg_degree!r} must be > 0")


class _FullGraphDataModule(pl.LightningDataModule):
    """One graph, served whole: ``steps_per_epoch`` times per training epoch, once for
    validation."""

    def __init__(self, steps_per_epoch: int) -> None:
        super().__init__()
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch={steps_per_epoch!r} must be >= 1")
        self.steps_per_epoch = steps_per_epoch
        self.graph: Data | None = None
        self.source = ""

    def _graph(self) -> Data:
        if self.graph is None:
            raise RuntimeError(f"{type(self).__name__} is not set up: call setup('fit') first")
        return self.graph

    def train_dataloader(self) -> DataLoader:
        return DataLoader([self._graph()] * self.steps_per_epoch, batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader([self._graph()], batch_size=None)


class SBMGraphDataModule(_FullGraphDataModule):
    """The generated graph of :func:`make_sbm_graph`, offline (arguments as there).

    Args:
        num_nodes: number of nodes.
        num_classes: number of blocks, i.e. classes.
        num_features: node feature size.
        avg_degree: expected mean degree.
        homophily: expected share of intra-block edges.
        feature_signal: scale of the class centroids relative to the feature noise.
        train_fraction: share of labelled training nodes.
        val_fraction: share of validation nodes.
        steps_per_epoch: full-graph optimizer steps per training epoch.
        seed: seed of the generator.

    Example:
        >>> dm = SBMGraphDataModule(num_nodes=500, num_features=8)
        >>> dm.setup("fit")
        >>> len(dm.train_dataloader()), next(iter(dm.val_dataloader())).num_nodes
        (10, 500)
    """

    def __init__(
        self,
        num_nodes: int = 10_000,
        num_classes: int = 5,
        num_features: int = 64,
        avg_degree: float = 10.0,
        homophily: float = 0.7,
        feature_signal: float = 0.15,
        train_fraction: float = 0.1,
        val_fraction: float = 0.2,
        steps_per_epoch: int = 10,
        seed: int = 0,
    ) -> None:
        super().__init__(steps_per_epoch)
        self.options = {
            "num_nodes": num_nodes,
            "num_classes": num_classes,
            "num_features": num_features,
            "avg_degree": avg_degree,
            "homophily": homophily,
            "feature_signal": feature_signal,
            "train_fraction": train_fraction,
            "val_fraction": val_fraction,
            "seed": seed,
        }
        _check_sbm(num_nodes, num_classes, avg_degree, homophily, train_fraction, val_fraction)

    def setup(self, stage: str | None = None) -> None:
        if self.graph is None:
            self.graph = make_sbm_graph(**self.options)
            self.source = (
                f"SBM graph ({self.graph.num_nodes} nodes, {self.graph.num_edges} directed "
                f"edges, {self.options['num_classes']} classes)"
            )


class CoraDataModule(_FullGraphDataModule):
    """Planetoid Cora (2,708 papers, 7 classes, public split) through ``torch_geometric``.

    Downloaded once into ``root``; where there is no copy and the host does not answer
    within ``timeout_s``, or loading fails, this falls back to the offline default — an
    SBM graph with Cora's feature and class counts — with a warning, or raises if
    ``fallback`` is false.

    Args:
        root: directory of the data set files (``~`` is expanded).
        num_features: must be 1433 (checked; the model config reads it).
        num_classes: must be 7 (checked; the model config reads it).
        steps_per_epoch: full-graph optimizer steps per training epoch.
        fallback: train on the offline default when Cora is not available.
        timeout_s: seconds allowed for the network probe.
        seed: seed of the fallback's generator.

    Raises:
        ValueError: feature or class counts that Cora does not have.
        DataUnavailableError: Cora is not available and ``fallback`` is false.
    """

    def __init__(
        self,
        root: str = "~/.cache/lightning_acgc/data",
        num_features: int = 1433,
        num_classes: int = 7,
        steps_per_epoch: int = 10,
        fallback: bool = True,
        timeout_s: float = 3.0,
        seed: int = 0,
    ) -> None:
        super().__init__(steps_per_epoch)
        for name, value, want in (
            ("num_features", num_features, 1433),
            ("num_classes", num_classes, 7),
        ):
            if value != want:
                raise ValueError(f"{name}={value!r}: Cora has {name}={want}")
        self.root = root
        self.fallback = fallback
        self.timeout_s = timeout_s
        self.seed = seed

    def setup(self, stage: str | None = None) -> None:
        if self.graph is not None:
            return
        from torch_geometric.datasets import Planetoid
        from torch_geometric.transforms import NormalizeFeatures

        root = data_root(self.root) / "Planetoid"
        raw = root / "Cora" / "raw"
        have_copy = raw.is_dir() and len(list(raw.iterdir())) >= 8
        problem = None if have_copy else network_problem("github.com", timeout_s=self.timeout_s)
        if problem is None:
            try:
                self.graph = Planetoid(str(root), "Cora", transform=NormalizeFeatures())[0]
                self.source = "Planetoid Cora (public split)"
                return
            except (OSError, RuntimeError) as err:
                problem = f"loading failed: {type(err).__name__}: {err}"
        else:
            problem = f"no copy in {root} and {problem}"
        fall_back_or_raise("Cora", problem, "data=sbm", self.fallback)
        self.graph = make_sbm_graph(num_classes=7, num_features=1433, seed=self.seed)
        self.source = "SBM graph (7 classes, 1433 features) [fallback for Cora]"
