"""Codecs: what a saved tensor becomes. Importing this package registers the built-ins."""

from lightning_acgc.codecs import (  # noqa: F401  (registration)
    bounded,
    division,
    half,
    identity,
    intpack,
    mask,
    nonzero,
    quant,
    split,
)
from lightning_acgc.codecs.base import Codec, Packed
from lightning_acgc.codecs.registry import (
    available_codecs,
    build_codec,
    codec_config,
    codec_config_class,
    codec_option_names,
    register_codec,
)
from lightning_acgc.codecs.spec import CodecSpec, describe_codec

__all__ = [
    "Codec",
    "CodecSpec",
    "Packed",
    "available_codecs",
    "build_codec",
    "codec_config",
    "codec_config_class",
    "codec_option_names",
    "describe_codec",
    "register_codec",
]
