"""``fixed``: one codec setting for every site (baseline and ablations)."""

from __future__ import annotations

import dataclasses

import torch

from lightning_acgc.codecs.base import Codec
from lightning_acgc.config import CompressionConfig
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies.base import Policy

__all__ = ["FixedPolicy", "describe_codec"]


def describe_codec(codec: Codec) -> str:
    """``"bits=2 group_size=256"``-style text of a codec's config."""
    config = getattr(codec, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return ""
    return " ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config))


class FixedPolicy(Policy):
    """The same codec everywhere.

    Example:
        >>> from lightning_acgc.config import CompressionConfig
        >>> policy = FixedPolicy(CompressionConfig(codec="quant", codec_options={"bits": 4}))
        >>> policy.describe(policy.codec)
        'bits=4 group_size=256'
    """

    name = "fixed"

    def __init__(self, config: CompressionConfig) -> None:
        self.config = config
        self.codec = config.build_codec()

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        return self.codec
