"""Seeds of the stochastic codecs: one per site and step, from the engine's seed, so a
step's rounding is reproducible and no two sites round alike."""

from __future__ import annotations

import zlib

__all__ = ["mix", "site_seed"]

_MASK64 = (1 << 64) - 1


def mix(*values: int) -> int:
    """splitmix64 over the values: a well-spread 63-bit seed.

    Example:
        >>> mix(0, 1) == mix(0, 1), mix(0, 1) == mix(1, 0), 0 <= mix(7) < 2**63
        (True, False, True)
    """
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h & 0x7FFF_FFFF_FFFF_FFFF


def site_seed(seed: int, step: int, key: str, hashes: dict[str, int]) -> int:
    """The seed of site ``key`` on ``step``; ``hashes`` caches each key's CRC-32.

    Example:
        >>> cache = {}
        >>> site_seed(0, 3, "fc:0", cache) == site_seed(0, 3, "fc:0", cache), list(cache)
        (True, ['fc:0'])
    """
    h = hashes.get(key)
    if h is None:
        h = hashes[key] = zlib.crc32(key.encode())
    return mix(seed, step, h)
