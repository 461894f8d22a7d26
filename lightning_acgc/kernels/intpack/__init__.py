"""``intpack`` kernels: lossless frame-of-reference bit packing of integer tensors, the
compiled CPU path for CPU tensors and the pure-torch reference elsewhere (there is no
Triton kernel: CUDA tensors take the reference's torch ops); see
:mod:`lightning_acgc.kernels.intpack.reference` for the format."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.dispatch import route
from lightning_acgc.kernels.intpack.cpu import intpack_decode_cpu, intpack_encode_cpu
from lightning_acgc.kernels.intpack.reference import (
    INT_DTYPES,
    intpack_decode_ref,
    intpack_encode_ref,
)

__all__ = [
    "INT_DTYPES",
    "intpack_decode",
    "intpack_decode_ref",
    "intpack_encode",
    "intpack_encode_ref",
]


def intpack_encode(
    x: torch.Tensor, group_size: int, *, backend: str = "auto"
) -> dict[str, torch.Tensor]:
    """Pack a non-empty integer tensor of a dtype in :data:`INT_DTYPES`.

    Example:
        >>> p = intpack_encode(torch.tensor([7, 8, 9, 10]), group_size=8)
        >>> p["base"].tolist(), int(p["width"]), p["bits"].numel()
        ([7], 2, 1)
    """
    return route(x, backend, intpack_encode_ref, None, intpack_encode_cpu)(x, group_size)


def intpack_decode(
    payload: dict[str, torch.Tensor],
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Flat tensor of the ``numel`` packed values in ``dtype`` (exact).

    Example:
        >>> p = intpack_encode(torch.tensor([7, 8, 9, 10]), group_size=8)
        >>> intpack_decode(p, 8, 4, torch.int64).tolist()
        [7, 8, 9, 10]
    """
    fn = route(payload["base"], backend, intpack_decode_ref, None, intpack_decode_cpu)
    return fn(payload, group_size, numel, dtype)
