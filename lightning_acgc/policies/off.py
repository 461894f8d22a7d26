"""``off``: compress nothing (the adapter installs no hooks at all for it)."""

from __future__ import annotations

import torch

from lightning_acgc.codecs.base import Codec
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies.base import Policy

__all__ = ["OffPolicy"]


class OffPolicy(Policy):
    """Keeps every tensor as it is; training is bit-identical to plain training."""

    name = "off"

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        return None
