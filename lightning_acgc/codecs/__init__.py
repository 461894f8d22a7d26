"""Codecs: what a saved tensor becomes. Importing this package registers the built-ins."""

from lightning_acgc.codecs import (  # noqa: F401  (registration)
    bounded,
    division,
    identity,
    intpack,
    mask,
    quant,
)
from lightning_acgc.codecs.base import Codec, Packed
from lightning_acgc.codecs.registry import (
    available_codecs,
    build_codec,
    codec_config_class,
    register_codec,
)

__all__ = [
    "Codec",
    "Packed",
    "available_codecs",
    "build_codec",
    "codec_config_class",
    "register_codec",
]
