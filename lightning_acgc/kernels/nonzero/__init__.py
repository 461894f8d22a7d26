"""``nonzero`` kernels: a floating tensor split into a 1-bit mask of its non-zero elements
and their compacted values, and merged back bit for bit; the compiled CPU path for CPU
tensors of a dtype in :data:`~lightning_acgc.kernels.nonzero.cpu.CPU_DTYPES`, the pure-torch
reference elsewhere (there is no Triton kernel: CUDA tensors take the reference's torch
ops); see :mod:`lightning_acgc.kernels.nonzero.reference` for the format."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.dispatch import route
from lightning_acgc.kernels.nonzero.cpu import CPU_DTYPES, nonzero_merge_cpu, nonzero_split_cpu
from lightning_acgc.kernels.nonzero.reference import nonzero_merge_ref, nonzero_split_ref

__all__ = [
    "nonzero_count",
    "nonzero_merge",
    "nonzero_merge_ref",
    "nonzero_split",
    "nonzero_split_ref",
]

# the number of set bits of each byte value
_POPCOUNT = torch.tensor([bin(b).count("1") for b in range(256)], dtype=torch.uint8)


def nonzero_split(x: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits, values)`` of ``x`` (any shape and layout): ``bits`` flags the elements with
    any bit set (uint8, ``ceil(numel / 8)`` bytes, the ``mask`` layout), ``values`` holds
    them in order (1-D, ``x.dtype``). The CPU path's ``values`` may be a view of a buffer
    with room for every element: consume it right away, or ``.clone()`` it.

    Example:
        >>> bits, values = nonzero_split(torch.tensor([[0.0, 2.0], [-0.0, 3.0]]))
        >>> bits.tolist(), values.tolist()
        ([14], [2.0, -0.0, 3.0])
    """
    cpu = nonzero_split_cpu if x.dtype in CPU_DTYPES else None
    return route(x, backend, nonzero_split_ref, None, cpu)(x)


def nonzero_merge(
    bits: torch.Tensor,
    values: torch.Tensor,
    numel: int,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The flat tensor of ``numel`` elements of ``values.dtype`` split into ``bits`` and
    ``values`` by :func:`nonzero_split`: ``+0.0`` where a bit is clear, the values in
    order where it is set. ``out``, a contiguous tensor of ``numel`` elements, is written
    in place and returned when given.

    Raises:
        TypeError: ``bits`` not uint8, ``out`` of another dtype than ``values``.
        ValueError: ``bits`` too short, the set bits and the values differ in number, or
            ``out`` not a contiguous tensor of ``numel`` elements.

    Example:
        >>> bits, values = nonzero_split(torch.tensor([0.0, 2.0, -0.0, 3.0]))
        >>> nonzero_merge(bits, values, 4).tolist()
        [0.0, 2.0, -0.0, 3.0]
    """
    cpu = nonzero_merge_cpu if values.dtype in CPU_DTYPES else None
    return route(bits, backend, nonzero_merge_ref, None, cpu)(bits, values, numel, out)


def nonzero_count(bits: torch.Tensor, numel: int) -> int:
    """The number of set bits among the first ``numel`` of ``bits`` (uint8, any device).

    Example:
        >>> nonzero_count(torch.tensor([255, 3], dtype=torch.uint8), 9)
        9
    """
    if bits.dtype != torch.uint8:
        raise TypeError(f"bits must be uint8, got {bits.dtype}")
    if numel < 0 or bits.numel() * 8 < numel:
        raise ValueError(f"numel={numel} does not fit in {bits.numel()} bytes of bits")
    flat = bits.reshape(-1)[: -(-numel // 8)]
    if numel % 8:  # the last byte's bits past numel do not count
        flat = flat.clone()
        flat[-1] &= (1 << (numel % 8)) - 1
    table = _POPCOUNT.to(bits.device)
    return int(table[flat.long()].sum(dtype=torch.int64))
