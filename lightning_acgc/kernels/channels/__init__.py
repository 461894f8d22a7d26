"""Per-channel normalization kernels (what :mod:`lightning_acgc.codecs.channels` puts in
front of a codec), routed by :func:`lightning_acgc.kernels.common.dispatch.route`: Triton
for CUDA tensors, the compiled CPU path for CPU tensors, the torch reference for what
those do not take (other dtypes, strided layouts) and with ``backend="torch"``."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.channels.cpu import normalize_channels_cpu
from lightning_acgc.kernels.channels.reference import channel_ranges
from lightning_acgc.kernels.channels.reference import normalize_channels as normalize_ref
from lightning_acgc.kernels.common.dispatch import route

__all__ = ["channel_ranges", "normalize_channels", "normalize_ref"]

_TRITON = "lightning_acgc.kernels.channels.triton:normalize_channels_triton"
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def normalize_channels(
    x: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, m, s)``: ``y = (x − m)/s`` in fp32, ``m`` and ``s`` each channel's midpoint
    and half range (dimension 1), shaped to broadcast against ``x`` (channels with a
    NaN or ±inf, or a half range below 1e-30 but above 0, get ``m = 0, s = 1``; those
    with ``s = 0`` give ``y = 0``).

    Example:
        >>> y, m, s = normalize_channels(torch.tensor([[1.0, -2.0], [3.0, 2.0]]))
        >>> y.tolist(), m.flatten().tolist(), s.flatten().tolist()
        ([[-1.0, -1.0], [1.0, 1.0]], [2.0, 0.0], [1.0, 2.0])
    """
    # a layout or dtype the kernel does not take routes as a family without one would
    fits = x.dtype in _TRITON_DTYPES and x.is_contiguous() and x.dim() >= 2 and x.numel() > 0
    return route(x, backend, normalize_ref, _TRITON if fits else None, normalize_channels_cpu)(x)
