"""``division``: block-average low-pass at higher precision + few-bit residual (DIVISION)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_acgc.codecs._checks import check_bits, check_choice, check_group_size
from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.identity import raw_packed
from lightning_acgc.codecs.registry import register_codec
from lightning_acgc.kernels import division as dk

__all__ = ["DivisionCodec", "DivisionConfig"]

_LOW_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class DivisionConfig:
    """Options of the ``division`` codec.

    Args:
        block: edge of the average-pool tiles (``block x block`` on H, W of NCHW maps;
            ``block`` steps along a sequence or a last axis).
        residual_bits: bits per value of the high-frequency residual, one of 1, 2, 4, 8.
        group_size: residual values sharing one min/scale pair (positive multiple of 8).
        low_dtype: dtype of the stored averages: "bfloat16", "float16" or "float32".

    Raises:
        ValueError: a field outside its allowed values (the message names it).
    """

    block: int = 8
    residual_bits: int = 2
    group_size: int = 256
    low_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block <= 0:
            raise ValueError(f"block={self.block!r} must be an integer > 0 (e.g. 8)")
        check_bits("residual_bits", self.residual_bits)
        check_group_size("group_size", self.group_size)
        check_choice("low_dtype", self.low_dtype, tuple(_LOW_DTYPES))


@register_codec("division", DivisionConfig)
class DivisionCodec:
    """Dual precision (DIVISION, ICML 2023): a block-average copy in ``low_dtype`` plus the
    residual ``x - upsample(low)`` quantized per group with unbiased stochastic rounding.

    NaN/inf survive exactly; in a non-negative tensor with exact zeros (ReLU outputs) the
    zeros stay exact and no positive value decodes to 0. Declines non-floating and
    float64 tensors (``encode`` returns ``None``).

    Example:
        >>> import torch
        >>> codec = DivisionCodec(DivisionConfig(block=4, residual_bits=8))
        >>> x = torch.randn(2, 3, 16, 16)
        >>> packed = codec.encode(x, seed=1)
        >>> (codec.decode(packed) - x).abs().max().item() < 0.05
        True
        >>> packed.nbytes < x.numel() * x.element_size() // 3
        True
    """

    backend = "auto"

    def __init__(self, config: DivisionConfig) -> None:
        self.config = config

    def encode(self, x: torch.Tensor, seed: int) -> Packed | None:
        if not x.is_floating_point() or x.dtype == torch.float64:
            return None
        if x.numel() == 0:
            return raw_packed(x)
        c = self.config
        payload = dk.division_encode(
            x,
            c.block,
            c.residual_bits,
            c.group_size,
            _LOW_DTYPES[c.low_dtype],
            seed,
            backend=self.backend,
        )
        meta = {
            "block": c.block,
            "residual_bits": c.residual_bits,
            "group_size": c.group_size,
            "low_dtype": c.low_dtype,
            "seed": seed,
        }
        return Packed(self.name, x.shape, x.dtype, payload, meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        if packed.codec != self.name:  # an empty tensor kept raw by ``encode``
            return packed.payload["raw"]
        m = packed.meta
        return dk.division_decode(
            packed.payload,
            packed.shape,
            packed.dtype,
            m["block"],
            m["residual_bits"],
            m["group_size"],
            backend=self.backend,
        )
