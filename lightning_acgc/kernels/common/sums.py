"""Squared norms of gradient tables in float64 (acgc's calibration statistics): one
compiled pass over float32 CPU tensors (``csrc/sums.c``), torch elsewhere, routed by
:func:`~lightning_acgc.kernels.common.dispatch.route`."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads
from lightning_acgc.kernels.common.dispatch import route

__all__ = ["dense", "squared_sum", "squared_sum_cpu", "squared_sum_ref"]


def squared_sum_ref(a: torch.Tensor, b: torch.Tensor | None = None) -> float:
    """‖a − b‖² (``b`` None: ‖a‖²), the difference in ``a``'s dtype, the squares summed in
    float64 without a float64 copy of the input (the copies and their squares took a
    quarter of a BERT-base calibration step; a float32 sum of 30M values was 0.3% off)."""
    x = a.detach() if b is None else a.detach() - b.detach().to(a.dtype)
    return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2


def squared_sum_cpu(a: torch.Tensor, b: torch.Tensor | None = None) -> float:
    """:func:`squared_sum_ref` of float32 CPU tensors in one pass, no difference tensor;
    the same sum for any number of threads (its order differs from torch's, so the two
    can differ in the last bits of the float64 result)."""
    x = a.detach().contiguous()
    y = None if b is None else b.detach().contiguous()
    ptr = None if y is None else y.data_ptr()
    return float(cpu_library().acgc_squared_sum_f32(x.data_ptr(), ptr, x.numel(), cpu_threads()))


def squared_sum(a: torch.Tensor, b: torch.Tensor | None = None) -> float:
    """‖a − b‖² (``b`` None: ‖a‖²) in float64: :func:`squared_sum_cpu` where both are
    dense float32 tensors of one shape (on the CPU, with the library built), else
    :func:`squared_sum_ref`.

    Example:
        >>> squared_sum(torch.tensor([3.0, 4.0])), squared_sum(torch.ones(3), torch.zeros(3))
        (25.0, 3.0)
    """
    pair = (a,) if b is None else (a, b)
    same = b is None or (b.shape == a.shape and b.device == a.device)
    flat32 = same and all(t.dtype == torch.float32 and not t.is_sparse for t in pair)
    return route(a, "auto", squared_sum_ref, None, squared_sum_cpu if flat32 else None)(a, b)


def dense(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a strided tensor (a sparse one, an ``Embedding(sparse=True)``'s, made
    dense: the error statistics compare gradients element by element).

    Example:
        >>> dense(torch.eye(2).to_sparse()).layout
        torch.strided
    """
    return grad if grad.layout == torch.strided else grad.to_dense()
