"""``mask``: bool tensors and two-valued tensors (dropout masks) at 1 bit per element."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.identity import raw_packed
from lightning_acgc.codecs.registry import register_codec
from lightning_acgc.kernels.mask import mask_pack, mask_select, mask_two_valued, mask_unpack

__all__ = ["MaskCodec", "MaskConfig"]


@dataclass(frozen=True)
class MaskConfig:
    """``mask`` takes no options: it is lossless."""


@register_codec("mask", MaskConfig)
class MaskCodec:
    """Lossless 1-bit coding of bool tensors and of tensors holding two distinct values.

    Any other tensor is declined (``encode`` returns ``None``) and kept as it is.

    Example:
        >>> import torch
        >>> codec = MaskCodec(MaskConfig())
        >>> m = torch.rand(1000) > 0.5
        >>> packed = codec.encode(m, seed=0)
        >>> torch.equal(codec.decode(packed), m), packed.nbytes
        (True, 125)
    """

    backend = "auto"

    def __init__(self, config: MaskConfig) -> None:
        self.config = config

    def encode(self, x: torch.Tensor, seed: int) -> Packed | None:
        if x.numel() == 0:
            return raw_packed(x)
        if x.dtype == torch.bool:
            bits = mask_pack(x, self.backend)
            return Packed(self.name, x.shape, x.dtype, {"bits": bits})
        if not x.is_floating_point() or x.is_complex():
            return None
        two = mask_two_valued(x, self.backend)  # None: more than two values, or a NaN
        if two is None:
            return None
        bits, values = two
        return Packed(self.name, x.shape, x.dtype, {"bits": bits, "values": values})

    def decode(self, packed: Packed) -> torch.Tensor:
        if packed.codec == "identity":  # empty tensors are kept raw
            return packed.payload["raw"]
        bits, numel = packed.payload["bits"], packed.shape.numel()
        if packed.dtype == torch.bool:
            return mask_unpack(bits, numel, self.backend).view(packed.shape)
        return mask_select(bits, numel, packed.payload["values"], self.backend).view(packed.shape)
