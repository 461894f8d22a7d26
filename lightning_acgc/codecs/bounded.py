"""``bounded``: error-bounded coding, ``|x - x̂| <= eb`` for every element, guaranteed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_acgc.codecs._checks import check_group_size, check_positive
from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.identity import raw_packed
from lightning_acgc.codecs.registry import register_codec
from lightning_acgc.kernels import bounded as bk

__all__ = ["BoundedCodec", "BoundedConfig"]


@dataclass(frozen=True)
class BoundedConfig:
    """Options of the ``bounded`` codec.

    Args:
        error_bound: the largest allowed ``|x - x̂|`` per element (finite, > 0); with
            ``relative=True`` a fraction of the tensor's range instead.
        relative: the absolute bound is ``error_bound * (max - min)`` over the tensor's
            finite values (a constant tensor then costs no code bits).
        group_size: values sharing one base/step/width (positive multiple of 8).

    Raises:
        ValueError: a field out of its allowed range (the message names it).
    """

    error_bound: float = 1e-2
    relative: bool = False
    group_size: int = 256

    def __post_init__(self) -> None:
        check_positive("error_bound", self.error_bound)
        if not math.isfinite(self.error_bound):
            raise ValueError(f"error_bound={self.error_bound!r} must be a finite number > 0")
        if not isinstance(self.relative, bool):
            raise ValueError(f"relative={self.relative!r} is not allowed; allowed values: bool")
        check_group_size("group_size", self.group_size)


@register_codec("bounded", BoundedConfig)
class BoundedCodec:
    """Per-group fewest-bits coding within an absolute (or relative) error bound.

    Each group of ``group_size`` values stores a base, a step and codes of the fewest
    bits (0..16) that keep every element within the bound; groups that cannot be
    coded are kept raw and the rare element that would miss the bound after float
    rounding is kept exactly, so the bound holds for every element in the output
    dtype. Exact zeros stay zero, positives of non-negative groups stay positive, and
    NaN/inf survive. Takes float32, float16 and bfloat16 tensors; declines others.

    Example:
        >>> import torch
        >>> codec = BoundedCodec(BoundedConfig(error_bound=0.01))
        >>> x = torch.randn(4, 1000)
        >>> packed = codec.encode(x, seed=0)
        >>> bool((codec.decode(packed) - x).abs().max() <= 0.01)
        True
        >>> packed.nbytes < x.numel() * 4 // 3
        True
    """

    backend = "auto"

    def __init__(self, config: BoundedConfig) -> None:
        self.config = config

    def encode(self, x: torch.Tensor, seed: int) -> Packed | None:
        if x.dtype not in bk.SUPPORTED_DTYPES:
            return None
        if x.numel() == 0:
            return raw_packed(x)
        c = self.config
        payload = bk.bounded_encode(
            x, c.error_bound, c.group_size, c.relative, backend=self.backend
        )
        meta = {"error_bound": c.error_bound, "relative": c.relative, "group_size": c.group_size}
        return Packed(self.name, x.shape, x.dtype, payload, meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        if packed.codec != self.name:  # an empty tensor kept raw by ``encode``
            return packed.payload["raw"]
        flat = bk.bounded_decode(
            packed.payload,
            packed.meta["group_size"],
            packed.shape.numel(),
            packed.dtype,
            backend=self.backend,
        )
        return flat.view(packed.shape)
