"""``division``: DIVISION's fixed split for conv-like and sequence activations."""

from __future__ import annotations

import torch

from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies.base import Policy

__all__ = ["DivisionPolicy"]


class DivisionPolicy(Policy):
    """Block-average low-frequency copy (bf16) plus a few-bit residual for 3-D to 5-D
    tensors (sequences, feature maps); ``quant`` for the rest. No calibration.

    Args:
        block: pooling block (per pooled axis).
        residual_bits: bits of the high-frequency residual.
        quant_bits: bits of ``quant`` for tensors of other ranks.
        group_size: values per quantization group.
        config: the codec (one of ``codecs``) and its backend.

    Example:
        >>> import torch
        >>> from lightning_acgc.engine.sites import SiteInfo
        >>> policy = DivisionPolicy()
        >>> site = SiteInfo("conv", "Conv2d", 0)
        >>> policy.codec_for(site, torch.zeros(2, 3, 8, 8)).name
        'division'
        >>> policy.codec_for(site, torch.zeros(4, 8)).name
        'quant'
    """

    name = "division"
    codecs = ("division",)  # what codec= may name; the first is the default
    options = (
        "block",
        "residual_bits",
        "quant_bits",
        "group_size",
    )

    def __init__(
        self,
        block: int = 8,
        residual_bits: int = 2,
        quant_bits: int = 2,
        group_size: int = 256,
        config: CodecSpec | None = None,
    ) -> None:
        self.config = config or CodecSpec("division")

        def build(codec: str, options: dict) -> Codec:
            return CodecSpec(codec, options, self.config.backend).build()

        self.division = build(
            "division",
            {"block": block, "residual_bits": residual_bits, "group_size": group_size},
        )
        self.quant = build("quant", {"bits": quant_bits, "group_size": group_size})

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        return self.division if 3 <= x.dim() <= 5 else self.quant
