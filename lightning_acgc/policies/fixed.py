"""``fixed``: one codec setting for every site (baseline and ablations)."""

from __future__ import annotations

import torch

from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies.base import Policy

__all__ = ["FixedPolicy"]


class FixedPolicy(Policy):
    """The same codec everywhere.

    Args:
        config: the codec and its options (default: ``quant`` with its defaults).

    Example:
        >>> from lightning_acgc.codecs import CodecSpec
        >>> policy = FixedPolicy(CodecSpec("quant", {"bits": 4}))
        >>> policy.describe(policy.codec)
        'bits=4 group_size=256 meta=fp32'
    """

    name = "fixed"
    codecs = None  # any registered codec
    takes_codec_options = True

    def __init__(self, config: CodecSpec | None = None) -> None:
        self.config = config or CodecSpec()
        self.codec = self.config.build()
        # the identity codec is the control: the engine compresses nothing, masks and
        # integer tensors included
        self.control = self.codec.name == "identity"

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        return self.codec
