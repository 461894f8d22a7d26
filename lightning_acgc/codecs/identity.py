"""``identity``: keeps the tensor as it is — the control, and the holder of raw data."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.registry import register_codec

__all__ = ["IdentityCodec", "IdentityConfig", "raw_packed"]


@dataclass(frozen=True)
class IdentityConfig:
    """``identity`` takes no options."""


def raw_packed(x: torch.Tensor) -> Packed:
    """A :class:`Packed` that holds ``x`` itself (used for empty tensors by every codec)."""
    return Packed("identity", x.shape, x.dtype, {"raw": x})


@register_codec("identity", IdentityConfig)
class IdentityCodec:
    """Stores every tensor unchanged; compression off, bit-identical gradients.

    Example:
        >>> import torch
        >>> codec = IdentityCodec(IdentityConfig())
        >>> x = torch.randn(3, 4)
        >>> torch.equal(codec.decode(codec.encode(x, seed=0)), x)
        True
    """

    backend = "auto"

    def __init__(self, config: IdentityConfig) -> None:
        self.config = config

    def encode(self, x: torch.Tensor, seed: int) -> Packed:
        return raw_packed(x)

    def decode(self, packed: Packed) -> torch.Tensor:
        return packed.payload["raw"]
