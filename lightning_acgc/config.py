"""User-facing configuration of the engine: one dataclass that checks itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lightning_acgc.codecs import build_codec, codec_config_class
from lightning_acgc.codecs._checks import BACKENDS, check_choice

__all__ = ["CompressionConfig"]


@dataclass
class CompressionConfig:
    """How saved activations are compressed when one codec is used everywhere.

    Args:
        codec: codec name (see :func:`lightning_acgc.available_codecs`).
        codec_options: the codec's own options, e.g. ``{"bits": 2}`` for ``quant`` or
            ``{"error_bound": 1e-3, "relative": True}`` for ``bounded``.
        min_numel: tensors with fewer elements are kept as they are.
        seed: base seed of every codec's random numbers (never the global RNG).
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
        compress_masks: bool tensors (dropout masks) go to the lossless ``mask`` codec.
        strict: re-raise codec errors instead of keeping the tensor uncompressed.

    Raises:
        ValueError: unknown codec or backend, a codec option it does not take or with a
            bad value, negative ``min_numel``.

    Example:
        >>> cfg = CompressionConfig.from_kwargs(codec="quant", bits=4)
        >>> cfg.codec, cfg.codec_options
        ('quant', {'bits': 4})
    """

    codec: str = "quant"
    codec_options: dict[str, Any] = field(default_factory=dict)
    min_numel: int = 1024
    seed: int = 0
    backend: str = "auto"
    compress_masks: bool = True
    strict: bool = False

    def __post_init__(self) -> None:
        codec_config_class(self.codec)  # unknown codec -> ValueError
        check_choice("backend", self.backend, BACKENDS)
        if (
            isinstance(self.min_numel, bool)
            or not isinstance(self.min_numel, int)
            or self.min_numel < 0
        ):
            raise ValueError(f"min_numel={self.min_numel!r} must be an int >= 0")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")
        build_codec(self.codec, self.codec_options)  # validates the codec's options now

    @classmethod
    def engine_fields(cls) -> set[str]:
        """Names of the fields that are not codec options."""
        return {f.name for f in dataclasses.fields(cls)} - {"codec_options"}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> CompressionConfig:
        """Split flat keyword arguments into engine fields and codec options."""
        engine = {k: kwargs.pop(k) for k in list(kwargs) if k in cls.engine_fields()}
        return cls(codec_options=kwargs, **engine)

    def build_codec(self):
        """The configured codec, with this config's backend."""
        codec = build_codec(self.codec, self.codec_options)
        codec.backend = self.backend
        return codec
