"""``half``: float32 tensors stored as float16, rounded to nearest (2x).

The widest setting the AC-GC policy allocates: 16 bits a value and no metadata, with an
error of at most half a float16 ulp (relative 2**-11 for normal values, at most 2**-25
absolute below float16's normal range): on a Gaussian tensor 1/1900 of the error
variance of 8-bit ``quant`` (groups of 256), on its ReLU 1/480. A tensor it would
change beyond that bound is declined and kept as it is: one holding a finite value
that rounds beyond float16's largest, 65504 (|x| ≥ 65520 rounds to inf). NaN and ±inf survive
the round trip; so does the sign of zero. Other dtypes (float16, bfloat16, float64,
integer) are declined.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_acgc.codecs.base import Packed
from lightning_acgc.codecs.identity import raw_packed
from lightning_acgc.codecs.registry import register_codec

__all__ = ["HALF_MAX", "HALF_SOURCE", "HalfCodec", "HalfConfig", "half_error_bound"]

HALF_MAX = 65504.0  # the largest finite float16
HALF_SOURCE = torch.float32  # the one dtype half packs; it declines every other
_HALF_TINY = 2.0**-14  # the smallest normal float16
_HALF_OVERFLOW = 65520.0  # float32 values of this magnitude and above round to inf
_HALF_MANTISSA = 10  # explicit significand bits of float16


def half_error_bound(x: torch.Tensor) -> torch.Tensor:
    """The largest error ``half`` may make on each element of ``x`` (float32): half a
    float16 ulp at |x|, for |x| up to 65504 (the ulp of a value below the normal range is
    that of the subnormals, 2**-24).

    Example:
        >>> half_error_bound(torch.tensor([1.0, 1000.0, 1e-6])).tolist()
        [0.00048828125, 0.25, 2.9802322387695312e-08]
    """
    a = x.detach().abs().float().clamp(min=_HALF_TINY)
    exponent = torch.frexp(a).exponent - 1  # a = m * 2**exponent, m in [1, 2)
    return torch.ldexp(torch.full_like(a, 0.5), exponent - _HALF_MANTISSA)


@dataclass(frozen=True)
class HalfConfig:
    """``half`` takes no options: it rounds to the nearest float16."""


@register_codec("half", HalfConfig)
class HalfCodec:
    """float32 tensors as float16 (round to nearest even), 2x smaller.

    Example:
        >>> import torch
        >>> codec = HalfCodec(HalfConfig())
        >>> x = torch.tensor([1.0, -3.14159, float("nan"), float("inf"), 1e-30])
        >>> y = codec.decode(codec.encode(x, seed=0))
        >>> y.dtype, y[:2].tolist(), y[2:].tolist()
        (torch.float32, [1.0, -3.140625], [nan, inf, 0.0])
        >>> codec.encode(torch.tensor([1e5]), seed=0) is None  # beyond float16's range
        True
    """

    backend = "auto"

    def __init__(self, config: HalfConfig) -> None:
        self.config = config

    def encode(self, x: torch.Tensor, seed: int) -> Packed | None:
        if x.dtype != HALF_SOURCE:
            return None
        if x.numel() == 0:
            return raw_packed(x)
        lo, hi = torch.aminmax(x)  # one pass; NaN or ±inf in x: checked element by element
        half = x.to(torch.float16)
        if not float(torch.maximum(-lo, hi)) < _HALF_OVERFLOW:
            overflow = torch.isinf(half)
            if bool(overflow.any()) and not torch.equal(overflow, torch.isinf(x)):
                return None  # a finite value would become inf
        return Packed(self.name, x.shape, x.dtype, {"half": half})

    def decode(self, packed: Packed) -> torch.Tensor:
        if packed.codec == "identity":  # empty tensors are kept raw
            return packed.payload["raw"]
        return packed.payload["half"].to(packed.dtype)
