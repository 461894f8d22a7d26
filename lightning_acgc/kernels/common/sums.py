"""Squared norms of gradient tables in float64: one compiled pass over a float32 CPU
tensor (``csrc/sums.c``), torch elsewhere."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads

__all__ = ["squared_sum", "squared_sum_ref"]


def squared_sum_ref(a: torch.Tensor, b: torch.Tensor | None = None) -> float:
    """‖a − b‖² (``b`` None: ‖a‖²), the difference in ``a``'s dtype, the squares summed in
    float64 (torch's norm accumulates without a float64 copy of its input)."""
    x = a.detach() if b is None else a.detach() - b.detach().to(a.dtype)
    return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2


def squared_sum(a: torch.Tensor, b: torch.Tensor | None = None) -> float:
    """:func:`squared_sum_ref`, in one compiled pass (no difference tensor) where ``a``
    (and ``b``) are float32 CPU tensors and the library is there; the sum's order differs
    from torch's, so the two can differ in the last bits of the float64 result.

    Example:
        >>> squared_sum(torch.tensor([3.0, 4.0])), squared_sum(torch.ones(3), torch.zeros(3))
        (25.0, 3.0)
    """
    compiled = a.dtype == torch.float32 and a.device.type == "cpu" and not a.is_sparse
    if b is not None:
        compiled = compiled and b.dtype == torch.float32 and b.device.type == "cpu"
        compiled = compiled and b.shape == a.shape and not b.is_sparse
    lib = cpu_library() if compiled else None
    if lib is None:
        return squared_sum_ref(a, b)
    x = a.detach().contiguous()
    y = None if b is None else b.detach().contiguous()
    ptr = None if y is None else y.data_ptr()
    return float(lib.acgc_squared_sum_f32(x.data_ptr(), ptr, x.numel(), cpu_threads()))
