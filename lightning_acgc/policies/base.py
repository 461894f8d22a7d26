"""What every policy offers the engine: a codec per site."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from lightning_acgc.codecs.base import Codec
from lightning_acgc.engine.sites import SiteInfo

__all__ = ["Policy"]


@runtime_checkable
class Policy(Protocol):
    """Chooses each site's codec. ``codec_for`` returns ``None`` to keep a tensor as it is."""

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None: ...

    def describe(self, codec: Codec) -> str:
        """Short text of a codec's settings for tables and logs."""
        ...
