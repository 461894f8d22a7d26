"""Scatter and index reductions by amax/amin of a (8, 12, 16) tensor: a GNN's max
aggregation of 12 messages (rows of the middle dimension) into 4 nodes."""

from __future__ import annotations

import torch


def nodes(t: torch.Tensor) -> torch.Tensor:
    """Which of 4 nodes each of 12 messages goes to."""
    return torch.arange(12, device=t.device) % 4


SCATTER_REDUCTIONS = {
    "scatter_amax": lambda t: t.new_zeros(8, 4, 16).scatter_reduce_(
        1, nodes(t).view(1, 12, 1).expand(8, 12, 16), t, "amax", include_self=False
    ),
    "scatter_amin_self": lambda t: t[:, :4].scatter_reduce(
        1, nodes(t).view(1, 12, 1).expand(8, 12, 16), t, "amin"
    ),
    "index_amax": lambda t: t.new_zeros(8, 4, 16).index_reduce_(
        1, nodes(t), t, "amax", include_self=False
    ),
}
