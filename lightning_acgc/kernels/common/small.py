"""Small CPU tensors of a payload made without ``torch.tensor``'s cost (3 us a call: a
tenth of what encoding 4 MB costs besides its passes over the data)."""

from __future__ import annotations

import array

import torch

__all__ = ["cpu_empty", "cpu_scalar", "cpu_values"]

_EMPTY: dict[torch.dtype, torch.Tensor] = {}


def cpu_empty(dtype: torch.dtype) -> torch.Tensor:
    """An empty CPU tensor of ``dtype``, one per dtype shared by every caller (it holds no
    bytes, and nothing resizes a payload's tensors).

    Example:
        >>> cpu_empty(torch.int64).numel(), cpu_empty(torch.int64) is cpu_empty(torch.int64)
        (0, True)
    """
    if dtype not in _EMPTY:
        _EMPTY[dtype] = torch.empty(0, dtype=dtype)
    return _EMPTY[dtype]


_TYPECODES = {torch.float64: "d", torch.float32: "f", torch.int64: "q", torch.uint8: "B"}


def cpu_values(values: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
    """A 1-d CPU tensor of ``values`` in ``dtype`` (float64, float32, int64 or uint8), each
    converted as ``torch.tensor(values, dtype=dtype)`` converts it.

    Example:
        >>> cpu_values((2, 112, -1), torch.int64).tolist()
        [2, 112, -1]
    """
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)


def cpu_scalar(value: float, dtype: torch.dtype) -> torch.Tensor:
    """A 0-d CPU tensor of ``value`` (as :func:`cpu_values`).

    Example:
        >>> cpu_scalar(0.25, torch.float64).item(), cpu_scalar(7, torch.uint8).dtype
        (0.25, torch.uint8)
    """
    return cpu_values((value,), dtype).view(())
