"""Compiled CPU path of the ``nonzero`` kernels (``common/csrc/nonzero.c``), bit-identical to
:mod:`lightning_acgc.kernels.nonzero.reference`: one call each way, over one chunk per
thread (bits and counts, a prefix sum, then AVX-512 compress/expand of the values)."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads
from lightning_acgc.kernels.nonzero.reference import check_merge_args

__all__ = ["CPU_DTYPES", "nonzero_merge_cpu", "nonzero_split_cpu"]

# the compiled path works on 4- and 2-byte bit patterns; other dtypes take the reference
CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in CPU_DTYPES:
        raise TypeError(f"the compiled nonzero path takes {list(CPU_DTYPES)}, got {dtype}")


def nonzero_split_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits, values)`` of a CPU tensor of a dtype in :data:`CPU_DTYPES` (any shape and
    layout). ``values`` is a view ``buf[:nnz]`` of a buffer of room for every element (one
    pass less than counting first; it is meant to be consumed right away: ``.clone()`` it
    to keep it without the spare room)."""
    _check_dtype(x.dtype)
    flat = x.contiguous().reshape(-1)
    n = flat.numel()
    bits = torch.empty(-(-n // 8), dtype=torch.uint8)
    buf = torch.empty(n, dtype=x.dtype)
    nnz = 0
    if n:
        nnz = cpu_library().acgc_nonzero_split(
            flat.data_ptr(), n, flat.element_size(), bits.data_ptr(), buf.data_ptr(),
            cpu_threads(),
        )  # fmt: skip
    return bits, buf[:nnz]


def nonzero_merge_cpu(
    bits: torch.Tensor, values: torch.Tensor, numel: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The flat tensor of ``numel`` elements that ``bits`` and ``values`` (CPU, a dtype in
    :data:`CPU_DTYPES`) were split from, into ``out`` when given.

    Raises:
        TypeError, ValueError: as the reference's
            :func:`~lightning_acgc.kernels.nonzero.reference.check_merge_args`; ValueError
            also where the set bits and the values differ in number.
    """
    _check_dtype(values.dtype)
    check_merge_args(bits, values, numel, out)
    bits, values = bits.contiguous(), values.contiguous()
    if out is None:
        out = torch.empty(numel, dtype=values.dtype)
    if numel:
        nnz = cpu_library().acgc_nonzero_merge(
            bits.data_ptr(), values.data_ptr(), values.numel(), numel, values.element_size(),
            out.data_ptr(), cpu_threads(),
        )  # fmt: skip
    else:
        nnz = 0
    if nnz != values.numel():
        raise ValueError(f"{nnz} set bits among numel={numel}, but {values.numel()} values")
    return out
