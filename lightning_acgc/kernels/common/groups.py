"""Flat tensors viewed as groups of a fixed size (shared by quant, bounded and gact)."""

from __future__ import annotations

import torch

__all__ = ["group_view"]


def group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x`` flattened to float32 and viewed as (G, group_size); the tail is padded
    with the last value so that padding never widens a group's range.

    Example:
        >>> group_view(torch.arange(5.0), 4).tolist()
        [[0.0, 1.0, 2.0, 3.0], [4.0, 4.0, 4.0, 4.0]]
    """
    flat = x.reshape(-1)
    flat = flat.float() if flat.dtype != torch.float32 else flat
    n = flat.numel()
    pad = -n % group_size
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.view(-1, group_size)
