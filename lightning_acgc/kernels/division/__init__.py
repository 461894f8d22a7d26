"""``division`` kernels (low-pass + quantized residual), routed to Triton (CUDA), the CPU
path with compiled quant/mask kernels, or the pure-torch reference (see
:func:`lightning_acgc.kernels.common.dispatch.route`). The format is described in
:mod:`lightning_acgc.kernels.division.reference`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_acgc.kernels.common.dispatch import route
from lightning_acgc.kernels.division.cpu import division_decode_cpu, division_encode_cpu
from lightning_acgc.kernels.division.reference import (
    division_decode_ref,
    division_encode_ref,
    division_lowpass_ref,
    division_upsample_ref,
    pool_axes,
)

__all__ = [
    "division_decode",
    "division_decode_ref",
    "division_encode",
    "division_encode_ref",
    "division_lowpass_ref",
    "division_upsample_ref",
    "pool_axes",
]

_TRITON = "lightning_acgc.kernels.division.triton"


def division_encode(
    x: torch.Tensor,
    block: int,
    residual_bits: int,
    group_size: int,
    low_dtype: torch.dtype,
    seed: int,
    backend: str = "auto",
) -> dict[str, torch.Tensor]:
    """Encode a non-empty floating tensor through the path :func:`route` picks."""
    fn = route(
        x, backend, division_encode_ref, f"{_TRITON}:division_encode_triton", division_encode_cpu
    )
    return fn(x, block, residual_bits, group_size, low_dtype, seed)


def division_decode(
    payload: dict[str, torch.Tensor],
    shape: Sequence[int],
    dtype: torch.dtype,
    block: int,
    residual_bits: int,
    group_size: int,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode a payload (of any path) to a tensor of ``shape`` and ``dtype``."""
    fn = route(
        payload["low"],
        backend,
        division_decode_ref,
        f"{_TRITON}:division_decode_triton",
        division_decode_cpu,
    )
    return fn(payload, shape, dtype, block, residual_bits, group_size)
