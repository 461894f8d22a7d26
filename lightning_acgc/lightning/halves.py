"""A training batch cut into two halves along its batch dimension, for the noise-relative
budget of ``acgc`` (the two halves' gradients measure the batch gradient's sampling
noise)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection

__all__ = ["split_batch"]


def _first_dims(batch: Any) -> list[int]:
    dims: list[int] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        dims.append(t.shape[0] if t.dim() > 0 else -1)
        return t

    apply_to_collection(batch, torch.Tensor, visit)
    return dims


def split_batch(batch: Any) -> tuple[Any, Any] | None:
    """The batch's two halves: every tensor of a (nested) list, tuple or dict sliced
    ``[:B//2]`` and ``[B//2:]`` along its first dimension B; other leaves are kept in
    both. ``None`` when there is no batch dimension to cut: no tensor, B < 2, tensors
    whose first dimensions differ, or an object that is not a plain collection (a
    ``torch_geometric`` graph, whose nodes are not independent samples).

    Example:
        >>> x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
        >>> first, second = split_batch({"x": x, "y": y, "name": "digits"})
        >>> first["y"].tolist(), second["y"].tolist(), second["name"]
        ([0, 1], [2, 3, 4], 'digits')
        >>> split_batch((torch.ones(1, 3),)) is None
        True
    """
    if not isinstance(batch, (torch.Tensor, Mapping, list, tuple)):
        return None
    dims = _first_dims(batch)
    if not dims or len(set(dims)) != 1 or dims[0] < 2:
        return None
    half = dims[0] // 2
    return (
        apply_to_collection(batch, torch.Tensor, lambda t: t[:half]),
        apply_to_collection(batch, torch.Tensor, lambda t: t[half:]),
    )
