"""Compiled CPU path of the per-channel normalization (``common/csrc/channels.c``), equal to
:func:`lightning_acgc.kernels.channels.reference.normalize_channels` (up to the sign of
zeros): one pass for the channels' ranges, one for the output, against the reference's
four passes and some twenty small ops."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.channels.reference import TINY
from lightning_acgc.kernels.channels.reference import normalize_channels as reference
from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads

__all__ = ["normalize_channels_cpu"]


def normalize_channels_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, m, s)`` as the reference computes them, for a contiguous float32 CPU tensor
    of at least two dimensions; any other tensor goes to the reference."""
    if x.dtype != torch.float32 or x.dim() < 2 or not x.is_contiguous() or x.numel() == 0:
        return reference(x)
    x = x.detach()
    n, c = x.shape[0], x.shape[1]
    plane = x.numel() // (n * c)
    rows = torch.empty(2 * n * c, dtype=torch.float32)
    bad = torch.empty(n * c, dtype=torch.uint8)
    m = torch.empty(c, dtype=torch.float32)
    s = torch.empty(c, dtype=torch.float32)
    y = torch.empty_like(x)
    cpu_library().acgc_channel_normalize(
        x.data_ptr(), n, c, plane, TINY, rows.data_ptr(), rows[n * c :].data_ptr(),
        bad.data_ptr(), m.data_ptr(), s.data_ptr(), y.data_ptr(), cpu_threads(),
    )  # fmt: skip
    shape = (1, c) + (1,) * (x.dim() - 2)
    return y, m.view(shape), s.view(shape)
