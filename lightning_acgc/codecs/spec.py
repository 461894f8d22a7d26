"""A codec choice as data: the codec's name, its own validated options and its backend."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lightning_acgc.codecs._checks import BACKENDS, check_choice
from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.registry import build_codec, codec_config

__all__ = ["CodecSpec", "describe_codec"]


def describe_codec(codec: Codec) -> str:
    """``"bits=2 group_size=256"``-style text of a codec's config."""
    config = getattr(codec, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return ""
    text = " ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config))
    if getattr(codec, "normalizes_channels", False):
        text += " per-channel"
    return text


@dataclass
class CodecSpec:
    """One codec with its options: what a policy builds its codecs from.

    Engine settings (``min_numel``, ``seed``, ...) are not here: they belong to
    :class:`~lightning_acgc.engine.EngineSettings`. The backend is here because it
    picks the kernels that run this codec.

    Args:
        codec: codec name (see :func:`lightning_acgc.available_codecs`).
        options: the codec's own options, e.g. ``{"bits": 2}`` for ``quant`` or
            ``{"error_bound": 1e-3, "relative": True}`` for ``bounded``.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.

    Raises:
        ValueError: unknown codec or backend, an option the codec does not take or one
            with a bad value.

    Example:
        >>> spec = CodecSpec("quant", {"bits": 4})
        >>> spec.build().config.bits, spec.describe()
        (4, 'codec=quant bits=4')
        >>> CodecSpec("quant", {"error_bound": 0.1})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: codec 'quant' does not take ['error_bound']; its options are [...]
    """

    codec: str = "quant"
    options: dict[str, Any] = field(default_factory=dict)
    backend: str = "auto"

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, BACKENDS)
        self.options = dict(self.options)
        codec_config(self.codec, self.options)  # unknown codec or bad option -> ValueError

    def build(self) -> Codec:
        """The codec, running on this spec's backend."""
        codec = build_codec(self.codec, self.options)
        codec.backend = self.backend  # type: ignore[attr-defined]
        return codec

    def describe(self) -> str:
        """``"codec=quant bits=4"``: the codec and the options given."""
        options = (f"{k}={v}" for k, v in sorted(self.options.items()))
        return " ".join([f"codec={self.codec}", *options])
