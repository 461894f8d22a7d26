"""``nonzero``: a 1-bit mask of where a tensor is not zero, and only those values quantized.

A ReLU output is about half zeros. ``quant`` keeps them exact, but spends a whole code
on each: at the 6-7 bits acgc gives a CNN's ReLU outputs at its default error, a zero
costs as much as any value. Here a zero costs one bit of the mask, and the values that
are not zero are packed together and stored as ``quant`` (or ``split``, for a fractional
width) stores any tensor: ``1 + p·(bits + metadata)`` bits a value for a share ``p`` of
non-zeros, against ``bits + metadata``. Zeros stay exact at every width, 1 bit included
(``quant`` at 1 bit cannot keep them: its two codes are a group's minimum and maximum).

"Zero" is +0.0 alone (every bit clear); −0.0, NaN, ±inf and denormals are values, so NaN
and inf survive as ``quant`` keeps them. The error bound of each value is its ``quant``
group's step, groups formed over the packed non-zero values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_acgc.codecs._checks import (
    QUANT_WIDTHS,
    check_choice,
    check_group_size,
    check_share,
)
from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.identity import raw_packed
from lightning_acgc.codecs.quant import QuantCodec, QuantWidthConfig
from lightning_acgc.codecs.registry import register_codec
from lightning_acgc.codecs.split import SplitCodec, SplitConfig
from lightning_acgc.kernels import nonzero as nk
from lightning_acgc.kernels import quant as qk

__all__ = ["NonzeroCodec", "NonzeroConfig"]

_VALUES = "values."  # payload prefix of the inner codec's tensors


@dataclass(frozen=True)
class NonzeroConfig:
    """Options of the ``nonzero`` codec.

    Args:
        bits: ``quant`` width of the non-zero values, 1 to 8.
        low_share: share of the non-zero values (whole groups) one bit narrower, as
            ``split`` stores them (0: all at ``bits``; needs ``bits`` >= 2 where > 0).
        group_size: values sharing one min/step pair (positive multiple of 8).
        meta: ``"fp32"`` or ``"bf16"`` group metadata (see ``quant``).
    """

    bits: int = 4
    low_share: float = 0.0
    group_size: int = 256
    meta: str = "fp32"

    def __post_init__(self) -> None:
        check_choice("bits", self.bits, QUANT_WIDTHS)
        check_share("low_share", self.low_share)
        if self.low_share > 0 and self.bits < 2:
            raise ValueError(f"low_share={self.low_share!r} needs bits >= 2 (got bits={self.bits})")
        check_group_size("group_size", self.group_size)
        check_choice("meta", self.meta, qk.META_FORMATS)

    @property
    def mean_bits(self) -> float:
        """Bits a non-zero value, metadata aside: ``bits − low_share``."""
        return self.bits - self.low_share


@register_codec("nonzero", NonzeroConfig)
class NonzeroCodec:
    """A mask of the non-zero values, and those values quantized.

    Example:
        >>> import torch
        >>> codec = NonzeroCodec(NonzeroConfig(bits=4))
        >>> x = torch.randn(4096).relu()
        >>> packed = codec.encode(x, seed=0)
        >>> y = codec.decode(packed)
        >>> bool((y[x == 0] == 0).all()), packed.nbytes < 4096 * 4 // 8 * 3 // 4 + 512
        (True, True)
    """

    backend = "auto"

    def __init__(self, config: NonzeroConfig) -> None:
        self.config = config
        c = config
        self._inner: QuantCodec | SplitCodec
        if c.low_share > 0:
            self._inner = SplitCodec(
                SplitConfig(c.bits, c.low_share, group_size=c.group_size, meta=c.meta)
            )
        else:
            self._inner = QuantCodec(
                QuantWidthConfig(bits=c.bits, group_size=c.group_size, meta=c.meta)
            )

    def _values_codec(self) -> QuantCodec | SplitCodec:
        self._inner.backend = self.backend  # set on this codec after construction (policies)
        return self._inner

    def encode(self, x: torch.Tensor, seed: int) -> Packed | None:
        if not x.is_floating_point() or x.dtype == torch.float64:
            return None
        if x.numel() == 0:
            return raw_packed(x)
        mask, values = nk.nonzero_split(x, backend=self.backend)
        payload = {"mask": mask}
        meta: dict = {"nnz": values.numel()}  # and the inner codec's name and meta
        if values.numel():
            inner = self._values_codec().encode(values, seed)
            if inner is None or inner.codec == "identity":  # a step beyond float32
                return raw_packed(x)
            payload.update({_VALUES + k: t for k, t in inner.payload.items()})
            meta["inner"] = (inner.codec, inner.meta)
        return Packed(self.name, x.shape, x.dtype, payload, meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        packed.settle()
        if packed.codec == "identity":
            return packed.payload["raw"]
        mask, numel, nnz = packed.payload["mask"], packed.shape.numel(), packed.meta["nnz"]
        if nnz:
            name, meta = packed.meta["inner"]
            inner = {
                k[len(_VALUES) :]: t for k, t in packed.payload.items() if k.startswith(_VALUES)
            }
            shape = torch.Size([nnz])
            values = self._values_codec().decode(Packed(name, shape, packed.dtype, inner, meta))
        else:
            values = torch.empty(0, dtype=packed.dtype, device=mask.device)
        out = torch.empty(numel, dtype=packed.dtype, device=mask.device)
        return nk.nonzero_merge(mask, values, numel, out=out, backend=self.backend).view(
            packed.shape
        )
