"""The quant codec's stochastic-rounding noise written out from its description, apart
from the library's code, for the tests of both paths (torch reference and compiled C)."""

from __future__ import annotations


def lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32 integer hash, as published."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def element_noise(i: int, key: int) -> float:
    """Element ``i``'s noise: a 16-bit half of its pair's hash (pair ``p = i >> 1``,
    ``lowbias32((p mod 2**32) ^ lowbias32((p >> 32) ^ key))``), the low half for even
    ``i``, times ``2**-16``."""
    p = i >> 1
    h = lowbias32((p & 0xFFFFFFFF) ^ lowbias32((p >> 32) ^ key))
    return (h & 0xFFFF if i % 2 == 0 else h >> 16) * 2.0**-16
