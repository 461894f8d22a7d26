"""The engine's own settings, apart from any codec choice."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineSettings"]


@dataclass(frozen=True)
class EngineSettings:
    """What the engine does around the codecs, whatever the policy chooses.

    Args:
        min_numel: tensors with fewer elements are kept as they are.
        seed: base of the per-step, per-site seeds kept with the packed data (codecs
            never draw from the global RNG).
        compress_masks: bool tensors (dropout masks) go to the lossless 1-bit ``mask``
            codec.
        strict: re-raise codec errors instead of keeping the tensor uncompressed.

    Raises:
        ValueError: a negative or non-int ``min_numel``, a non-int ``seed``.

    Example:
        >>> EngineSettings(min_numel=0).min_numel
        0
        >>> EngineSettings(min_numel=-1)
        Traceback (most recent call last):
        ...
        ValueError: min_numel=-1 must be an int >= 0
    """

    min_numel: int = 1024
    seed: int = 0
    compress_masks: bool = True
    strict: bool = False

    def __post_init__(self) -> None:
        if (
            isinstance(self.min_numel, bool)
            or not isinstance(self.min_numel, int)
            or self.min_numel < 0
        ):
            raise ValueError(f"min_numel={self.min_numel!r} must be an int >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")
