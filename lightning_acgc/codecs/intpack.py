"""``intpack``: integer tensors packed losslessly into the bits their values need."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_acgc.codecs._checks import check_group_size
from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.identity import raw_packed
from lightning_acgc.codecs.registry import register_codec
from lightning_acgc.kernels.intpack import INT_DTYPES, intpack_decode_ref, intpack_encode_ref

__all__ = ["IntPackCodec", "IntPackConfig"]


@dataclass(frozen=True)
class IntPackConfig:
    """Options of the ``intpack`` codec.

    Args:
        group_size: values sharing one int64 base (positive multiple of 8).
    """

    group_size: int = 256

    def __post_init__(self) -> None:
        check_group_size("group_size", self.group_size)


@register_codec("intpack", IntPackConfig)
class IntPackCodec:
    """Frame-of-reference + bit packing of integer tensors (pooling indices, token
    indices, offsets, ``edge_index``); decoding returns the exact tensor, dtype and shape.
    Floating and bool tensors are declined (``encode`` returns ``None``), and so is a
    tensor that packing would not shrink.

    Example:
        >>> import torch
        >>> codec = IntPackCodec(IntPackConfig())
        >>> idx = torch.randint(0, 1000, (4, 4096))
        >>> packed = codec.encode(idx, seed=0)
        >>> torch.equal(codec.decode(packed), idx), round(idx.numel() * 8 / packed.nbytes, 1)
        (True, 6.2)
    """

    backend = "auto"

    def __init__(self, config: IntPackConfig) -> None:
        self.config = config

    def encode(self, x: torch.Tensor, seed: int) -> Packed | None:
        if x.dtype not in INT_DTYPES:
            return None
        if x.numel() == 0:
            return raw_packed(x)
        payload = intpack_encode_ref(x, self.config.group_size)
        packed = Packed(
            self.name, x.shape, x.dtype, payload, {"group_size": self.config.group_size}
        )
        if packed.nbytes >= x.numel() * x.element_size():
            return None
        return packed

    def decode(self, packed: Packed) -> torch.Tensor:
        if packed.codec == "identity":
            return packed.payload["raw"]
        n = packed.shape.numel()
        flat = intpack_decode_ref(packed.payload, packed.meta["group_size"], n, packed.dtype)
        return flat.view(packed.shape)
