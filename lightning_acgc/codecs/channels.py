"""Per-channel normalization in front of a codec, for the inputs of BatchNorm.

BatchNorm's backward rebuilds x̂ = (x − μ_c)/σ_c from its saved input, so an error ε in
x reaches the gradient as ε/σ_c. A group codec like ``quant`` shares one min and step
among values of several channels whenever a channel's plane is smaller than the group
(a 4×4 plane has 16 values, a group 256): its step follows the widest channel, and a
channel of small σ_c then gets errors of many σ_c. In training that error feeds back
through every upstream δ; on the ResNet recipe fixed 2-bit quantization trained to 0.97
after 3 epochs and diverged to NaN in the fourth.

:class:`ChannelNormalized` encodes y = (x − m_c)/s_c instead, with m_c and s_c the
midpoint and half range of channel c (dimension 1), and keeps m_c and s_c in fp32 (8
bytes per channel). Every channel then spans [−1, 1] and a group's step suits all of
its channels. Decoding returns ŷ·s_c + m_c, so the error of x is the inner codec's
error of y times s_c: relative to each channel's own range, as BatchNorm needs.

Channels that hold NaN or ±inf are passed as they are (m = 0, s = 1); the inner codec
keeps non-finite values exactly. A constant channel has s = 0 and decodes exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_acgc.codecs.base import Codec, Packed

__all__ = ["ChannelNormalized", "channel_ranges", "normalize_channels"]

# Below this half range a channel is passed as it is: 1/s would overflow float32.
_TINY = 1e-30


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
    passed = ~(torch.isfinite(m) & torch.isfinite(s)) | ((s > 0) & (s < _TINY))
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


class ChannelNormalized:
    """``inner`` applied to each channel's values mapped onto [−1, 1] (see the module
    docstring). Tensors of fewer than two dimensions, empty ones and those the inner
    codec declines go to ``inner`` as they are.

    Args:
        inner: the codec that encodes the normalized values (e.g. ``quant``).

    Example:
        >>> from lightning_acgc.codecs.quant import QuantCodec, QuantConfig
        >>> codec = ChannelNormalized(QuantCodec(QuantConfig(bits=2)))
        >>> x = torch.randn(8, 16, 4, 4) * torch.logspace(-3, 3, 16).view(1, 16, 1, 1)
        >>> err = (codec.decode(codec.encode(x, seed=0)) - x).abs()
        >>> half_range = x.abs().amax(dim=(0, 2, 3), keepdim=True)
        >>> bool((err <= 2 * half_range / 3 + 1e-6 * half_range).all())  # per channel
        True
    """

    normalizes_channels = True

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.name = inner.name
        self.config: Any = getattr(inner, "config", None)

    def encode(self, x: torch.Tensor, seed: int) -> Packed | None:
        if x.dim() < 2 or x.numel() == 0 or not x.is_floating_point():
            return self.inner.encode(x, seed)
        y, m, s = normalize_channels(x)
        packed = self.inner.encode(y, seed)
        if packed is None:
            return None
        packed.payload["channel_mid"] = m
        packed.payload["channel_half_range"] = s
        packed.meta["channel_dtype"] = x.dtype
        return packed

    def decode(self, packed: Packed) -> torch.Tensor:
        y = self.inner.decode(packed)
        if "channel_mid" not in packed.payload:
            return y
        p = packed.payload
        m, s = p["channel_mid"], p["channel_half_range"]
        raw = packed.codec == "identity"  # the inner codec kept y raw: not in place
        x = torch.addcmul(m, y, s) if raw else y.mul_(s).add_(m)
        return x.to(packed.meta["channel_dtype"])
