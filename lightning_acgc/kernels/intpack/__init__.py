"""``intpack`` kernels: lossless frame-of-reference bit packing of integer tensors, the
compiled CPU path for CPU tensors and the pure-torch reference elsewhere (there is no
Triton kernel: CUDA tensors take the reference's torch ops); see
:mod:`lightning_acgc.kernels.intpack.reference` for the format, and
:mod:`lightning_acgc.kernels.intpack.window` for pooling indices' window mode."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.dispatch import route
from lightning_acgc.kernels.intpack.cpu import (
    intpack_decode_cpu,
    intpack_encode_cpu,
    window_decode_cpu,
    window_encode_cpu,
)
from lightning_acgc.kernels.intpack.reference import (
    INT_DTYPES,
    intpack_decode_ref,
    intpack_encode_ref,
)
from lightning_acgc.kernels.intpack.window import (
    window_decode_ref,
    window_encode_ref,
    window_fit,
)

__all__ = [
    "INT_DTYPES",
    "intpack_decode",
    "intpack_decode_ref",
    "intpack_encode",
    "intpack_encode_ref",
    "window_encode",
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
    if "window" in payload:  # window mode (window_encode)
        fn = route(payload["bits"], backend, window_decode_ref, None, window_decode_cpu)
        return fn(payload, numel, dtype)
    fn = route(payload["base"], backend, intpack_decode_ref, None, intpack_decode_cpu)
    return fn(payload, group_size, numel, dtype)


def window_encode(x: torch.Tensor, *, backend: str = "auto") -> dict[str, torch.Tensor] | None:
    """Pooling indices (a contiguous integer tensor of >= 3 dimensions) packed against
    each output's window, or None where no window fits them in at most 8 bits a value
    (:mod:`lightning_acgc.kernels.intpack.window`); :func:`intpack_decode` reads it back.

    Example:
        >>> _, idx = torch.nn.functional.max_pool2d(torch.randn(4, 8, 32, 32), 2,
        ...                                         return_indices=True)
        >>> p = window_encode(idx)
        >>> int(p["width"]), torch.equal(intpack_decode(p, 0, idx.numel(), idx.dtype),
        ...                              idx.view(-1))
        (2, True)
    """
    if x.dim() < 3 or x.numel() == 0 or not x.is_contiguous() or x.dtype not in INT_DTYPES:
        return None
    fit = window_fit(x)
    if fit is None:
        return None
    return route(x, backend, window_encode_ref, None, window_encode_cpu)(x, *fit)
