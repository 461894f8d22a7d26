"""``bounded`` kernels (error-bounded per-group coding), routed to Triton (CUDA), the
compiled CPU path or the pure-torch reference (see
:func:`lightning_acgc.kernels.common.dispatch.route`). The format is described in
:mod:`lightning_acgc.kernels.bounded.reference`."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.bounded.cpu import bounded_decode_cpu, bounded_encode_cpu
from lightning_acgc.kernels.bounded.plan import (
    MAX_WIDTH,
    RAW_WIDTH,
    SUPPORTED_DTYPES,
    GroupPlan,
    group_plan,
)
from lightning_acgc.kernels.bounded.reference import bounded_decode_ref, bounded_encode_ref
from lightning_acgc.kernels.common.dispatch import route

__all__ = [
    "MAX_WIDTH",
    "RAW_WIDTH",
    "SUPPORTED_DTYPES",
    "GroupPlan",
    "bounded_decode",
    "bounded_decode_ref",
    "bounded_encode",
    "bounded_encode_ref",
    "group_plan",
]

_TRITON = "lightning_acgc.kernels.bounded.triton"


def bounded_encode(
    x: torch.Tensor,
    error_bound: float,
    group_size: int,
    relative: bool = False,
    backend: str = "auto",
) -> dict[str, torch.Tensor]:
    """Encode a non-empty floating tensor through the path :func:`route` picks."""
    fn = route(
        x, backend, bounded_encode_ref, f"{_TRITON}:bounded_encode_triton", bounded_encode_cpu
    )
    if fn is bounded_encode_ref or fn is bounded_encode_cpu:
        return fn(x, error_bound, group_size, relative)
    return fn(x.contiguous(), error_bound, group_size, relative)


def bounded_decode(
    payload: dict[str, torch.Tensor],
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode a payload (of any path) into a flat tensor of ``numel`` values."""
    fn = route(
        payload["lo"],
        backend,
        bounded_decode_ref,
        f"{_TRITON}:bounded_decode_triton",
        bounded_decode_cpu,
    )
    return fn(payload, group_size, numel, dtype)
