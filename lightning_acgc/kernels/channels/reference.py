"""Per-channel normalization in front of a codec, in torch: the specification of the
compiled CPU path (:mod:`lightning_acgc.kernels.channels.cpu`) and the path of every other
device. What it is for: :mod:`lightning_acgc.codecs.channels`."""

from __future__ import annotations

import torch

__all__ = ["TINY", "channel_ranges", "normalize_channels"]

# Below this half range a channel is passed as it is: 1/s would overflow float32.
TINY = 1e-30


def channel_ranges(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The midpoint ``m`` and half range ``s`` of every channel (dimension 1) of ``x``,
    fp32 and shaped to broadcast against ``x`` (``(1, C, 1, …)``). Channels with a
    non-finite value or a half range below 1e-30 (but above 0) get ``m = 0``, ``s = 1``.

    Example:
        >>> x = torch.tensor([[1.0, -2.0], [3.0, 2.0]])
        >>> m, s = channel_ranges(x)
        >>> m.flatten().tolist(), s.flatten().tolist()
        ([2.0, 0.0], [1.0, 2.0])
    """
    n, c = x.shape[0], x.shape[1]
    x = x.detach()
    plane = x.numel() // max(n * c, 1)
    if x.is_contiguous():  # per plane first (rows of the contiguous view), then over n
        rows = x.view(n * c, plane)  # (amin and amax: torch.aminmax is several times slower)
        lo = rows.amin(dim=1).view(n, c).amin(dim=0)
        hi = rows.amax(dim=1).view(n, c).amax(dim=0)
    else:  # one reduction over every other dimension (no copy of a strided layout)
        dims = (0, *range(2, x.dim()))
        lo, hi = x.amin(dim=dims), x.amax(dim=dims)
    lo, hi = lo.float(), hi.float()
    m = lo / 2 + hi / 2  # halves first: no overflow at ±float32 max
    s = hi / 2 - lo / 2
    passed = ~(torch.isfinite(m) & torch.isfinite(s)) | ((s > 0) & (s < TINY))
    m = torch.where(passed, torch.zeros_like(m), m)
    s = torch.where(passed, torch.ones_like(s), s)
    shape = (1, c) + (1,) * (x.dim() - 2)
    return m.view(shape), s.view(shape)


def normalize_channels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, m, s)``: ``y = (x − m)/s`` in fp32 with ``m, s`` from :func:`channel_ranges`
    (channels with ``s = 0`` give ``y = 0``).

    Example:
        >>> y, m, s = normalize_channels(torch.tensor([[1.0, -2.0], [3.0, 2.0]]))
        >>> y.tolist()
        [[-1.0, -1.0], [1.0, 1.0]]
    """
    m, s = channel_ranges(x)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    y = torch.sub(x, m)  # fp32 (m is); then in place: addcmul's broadcast is slower
    return y.mul_(inv), m, s
