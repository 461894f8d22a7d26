"""What the engine needs from a policy: a structural protocol (the engine imports no
policy module; :class:`lightning_acgc.policies.Policy` is the base class that fills it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from lightning_acgc.codecs.base import Codec
from lightning_acgc.engine.sites import SiteInfo

if TYPE_CHECKING:
    from lightning_acgc.engine.compressor import ActivationCompressor

__all__ = ["Policy", "Reduce"]

# Averages a tensor over data-parallel ranks (identity on one process).
Reduce = Callable[[torch.Tensor], torch.Tensor]


@runtime_checkable
class Policy(Protocol):
    """Chooses each site's codec and calibrates once per step (see
    :class:`~lightning_acgc.engine.CalibrationCycle` for the order of the calls)."""

    name: str

    def attach(self, engine: ActivationCompressor) -> None: ...

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None: ...

    def describe(self, codec: Codec) -> str: ...

    def begin_step(self, step: int) -> None: ...

    def needs_exact_gradient(self, step: int) -> bool: ...

    def set_exact_gradients(
        self, grads: dict[str, torch.Tensor], reduce: Reduce | None = None
    ) -> None: ...

    def end_step(self, step: int, model: nn.Module, reduce: Reduce) -> None: ...

    def metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...
