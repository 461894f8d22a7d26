"""Node classification with ``torch_geometric``'s GCN, GraphSAGE or GAT (full batch)."""

from __future__ import annotations

import torch
from torch_geometric.data import Data
from torch_geometric.nn.models import GAT, GCN, GraphSAGE

from recipes.models.classifier import Classifier

__all__ = ["ARCHITECTURES", "GNNClassifier"]

ARCHITECTURES = {"gcn": GCN, "sage": GraphSAGE, "gat": GAT}


class GNNClassifier(Classifier):
    """A graph neural network over the whole graph; loss and accuracy on the stage's nodes.

    Batches are ``torch_geometric.data.Data`` with ``x``, ``edge_index``, ``y`` and the
    boolean node masks ``train_mask`` and ``val_mask``.

    Args:
        num_classes: number of node classes.
        in_channels: node feature size (from the data config).
        arch: ``"gcn"`` (Kipf & Welling), ``"sage"`` (GraphSAGE, mean aggregation) or
            ``"gat"`` (graph attention).
        hidden_channels: width of the hidden layers (for GAT, split over the heads).
        num_layers: message-passing layers.
        dropout: dropout between layers.
        heads: attention heads of GAT (must divide ``hidden_channels``; others ignore it).
        **optim: optimizer settings of :class:`~recipes.models.classifier.Classifier`.

    Raises:
        ValueError: an unknown ``arch`` or GAT heads that do not divide the width.

    Example:
        >>> module = GNNClassifier(num_classes=3, in_channels=8, arch="sage")
        >>> g = Data(x=torch.randn(5, 8), edge_index=torch.tensor([[0, 1], [1, 2]]),
        ...          y=torch.tensor([0, 1, 2, 0, 1]), train_mask=torch.ones(5, dtype=torch.bool))
        >>> logits, y = module.logits_and_targets(g, "train")
        >>> logits.shape
        torch.Size([5, 3])
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        arch: str = "gcn",
        hidden_channels: int = 64,
        num_layers: int = 2,
        dropout: float = 0.5,
        heads: int = 4,
        **optim: float | str,
    ) -> None:
        super().__init__(num_classes, **optim)  # type: ignore[arg-type]
        if arch not in ARCHITECTURES:
            raise ValueError(f"arch={arch!r} is unknown; allowed values: {sorted(ARCHITECTURES)}")
        if arch == "gat" and hidden_channels % heads:
            raise ValueError(f"heads={heads} must divide hidden_channels={hidden_channels}")
        self.save_hyperparameters()
        extra = {"heads": heads} if arch == "gat" else {}
        self.net = ARCHITECTURES[arch](
            in_channels,
            hidden_channels,
            num_layers,
            out_channels=num_classes,
            dropout=dropout,
            **extra,
        )

    def logits_and_targets(self, batch: Data, stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch[f"{stage}_mask"]
        logits = self.net(batch.x, batch.edge_index)
        return logits[mask], batch.y[mask]
