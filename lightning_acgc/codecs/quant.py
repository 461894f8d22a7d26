"""``quant``: per-group min/scale, 1 to 8 bits, unbiased seeded stochastic rounding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_acgc.codecs._checks import (
    ALLOWED_BITS,
    QUANT_WIDTHS,
    check_bits,
    check_choice,
    check_group_size,
)
from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.deferred import DeferredCheck
from lightning_acgc.codecs.identity import raw_packed
from lightning_acgc.codecs.registry import register_codec
from lightning_acgc.kernels import quant as qk

__all__ = ["QuantCodec", "QuantConfig", "QuantWidthConfig"]


@dataclass(frozen=True)
class QuantConfig:
    """Options of the ``quant`` codec.

    Args:
        bits: bits per value, one of 1, 2, 4, 8.
        group_size: values sharing one min/scale pair (positive multiple of 8; larger
            groups cost less metadata, e.g. 1024).
        meta: how each group's min and step are stored: ``"fp32"`` (64 bits per group)
            or ``"bf16"`` (32 bits, rounded so that every value stays within one step).
    """

    bits: int = 2
    group_size: int = 256
    meta: str = "fp32"
    widths = ALLOWED_BITS  # what ``bits`` may be (a class attribute, not an option)

    def __post_init__(self) -> None:
        check_bits("bits", self.bits, self.widths)
        check_group_size("group_size", self.group_size)
        check_choice("meta", self.meta, qk.META_FORMATS)


@dataclass(frozen=True)
class QuantWidthConfig(QuantConfig):
    """A :class:`QuantConfig` at any width from 1 to 8 bits, for policies that choose the
    width per tensor (acgc: 3 bits has a fifth of 2 bits' error for 1.5x the bytes,
    where 4 -> 8 bits, the only step before, cut it 289x for 2x the bytes). The codes of
    a width that does not divide 8 fill a little-endian bit stream (8 codes in ``bits``
    bytes); users set ``bits`` in 1, 2, 4, 8.

    Example:
        >>> import torch
        >>> codec = QuantCodec(QuantWidthConfig(bits=3))
        >>> x = torch.rand(1024)
        >>> packed = codec.encode(x, seed=0)
        >>> packed.payload["codes"].numel(), bool((codec.decode(packed) - x).abs().max() < 1 / 7)
        (384, True)
    """

    widths = QUANT_WIDTHS


@register_codec("quant", QuantConfig)
class QuantCodec:
    """Stochastic per-group quantization; zeros of non-negative groups stay exact.

    Example:
        >>> import torch
        >>> codec = QuantCodec(QuantConfig(bits=8))
        >>> x = torch.randn(4, 1000)
        >>> packed = codec.encode(x, seed=1)
        >>> (codec.decode(packed) - x).abs().max().item() < 0.05
        True
    """

    backend = "auto"

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    def encode(self, x: torch.Tensor, seed: int) -> Packed | None:
        return self._encode(x, seed, defer=False)

    def encode_deferred(self, x: torch.Tensor, seed: int) -> Packed | None:
        """:meth:`encode` without waiting for the device on the Triton path: the payload
        comes with a :class:`~lightning_acgc.codecs.deferred.DeferredCheck` (settled
        by ``packed.settle()``, by every decode at the latest), which keeps ``x`` until
        the verdict is in."""
        return self._encode(x, seed, defer=True)

    def _encode(self, x: torch.Tensor, seed: int, defer: bool) -> Packed | None:
        if not x.is_floating_point() or x.dtype == torch.float64:
            return None
        if x.numel() == 0:
            return raw_packed(x)
        payload, status = self.payload_of(x, seed, defer)
        if payload is None:  # a step beyond float32
            return raw_packed(x)
        check = None
        if status is not None:
            check = DeferredCheck([status], x, lambda source: self.encode(source, seed))
        return Packed(self.name, x.shape, x.dtype, payload, self.meta_of(seed), check=check)

    def meta_of(self, seed: int) -> dict[str, int]:
        """The ``meta`` of a payload encoded with ``seed``."""
        return {"bits": self.config.bits, "group_size": self.config.group_size, "seed": seed}

    def payload_of(
        self, x: torch.Tensor, seed: int, defer: bool
    ) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
        """``(payload, status)`` of a non-empty floating ``x``: the payload ``None``
        where a step overflows float32; ``status`` the device's verdict on a deferred
        (Triton) payload, valid where it is 0, else ``None`` (checked already)."""
        bits, group_size, meta = self.config.bits, self.config.group_size, self.config.meta
        if defer:
            return qk.quant_encode_deferred(
                x, bits, group_size, seed, backend=self.backend, meta=meta
            )
        payload = qk.quant_encode(
            x, bits, group_size, seed, backend=self.backend, meta=meta, reject_inf_steps=True
        )
        return payload, None

    def decode(self, packed: Packed) -> torch.Tensor:
        packed.settle()
        if packed.codec == "identity":  # empty tensors are kept raw
            return packed.payload["raw"]
        m = packed.meta
        flat = qk.quant_decode(
            packed.payload,
            m["bits"],
            m["group_size"],
            packed.shape.numel(),
            packed.dtype,
            backend=self.backend,
        )
        return flat.view(packed.shape)
