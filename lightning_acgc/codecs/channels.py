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

from collections.abc import Callable
from typing import Any

import torch

from lightning_acgc.codecs.base import Codec, Packed
from lightning_acgc.kernels.channels import channel_ranges, normalize_channels

__all__ = ["ChannelNormalized", "channel_ranges", "normalize_channels"]


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
        return self._encode(x, seed, self.inner.encode)

    def encode_deferred(self, x: torch.Tensor, seed: int) -> Packed | None:
        """:meth:`encode` with the inner codec's ``encode_deferred`` where it has one; its
        check, if any, keeps ``x`` (not the fp32 normalized copy, which goes at once) and
        encodes ``x`` again with :meth:`encode` if the verdict fails."""
        return self._encode(x, seed, getattr(self.inner, "encode_deferred", self.inner.encode))

    def _encode(
        self, x: torch.Tensor, seed: int, inner_encode: Callable[[torch.Tensor, int], Any]
    ) -> Packed | None:
        if x.dim() < 2 or x.numel() == 0 or not x.is_floating_point():
            return inner_encode(x, seed)
        y, m, s = normalize_channels(x, getattr(self.inner, "backend", "auto"))
        packed = inner_encode(y, seed)
        if packed is None:
            return None
        if packed.check is not None:
            packed.check.rebase(x, lambda source: self.encode(source, seed))
        packed.payload["channel_mid"] = m
        packed.payload["channel_half_range"] = s
        packed.meta["channel_dtype"] = x.dtype
        return packed

    def decode(self, packed: Packed) -> torch.Tensor:
        packed.settle()  # before reading the payload (the inner decode would, too late)
        y = self.inner.decode(packed)
        if "channel_mid" not in packed.payload:
            return y
        p = packed.payload
        m, s = p["channel_mid"], p["channel_half_range"]
        raw = packed.codec == "identity"  # the inner codec kept y raw: not in place
        x = torch.addcmul(m, y, s) if raw else y.mul_(s).add_(m)
        return x.to(packed.meta["channel_dtype"])
