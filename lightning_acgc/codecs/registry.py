"""Codec registry: a codec is added by a file and a :func:`register_codec` call."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lightning_acgc.codecs.base import Codec

__all__ = [
    "available_codecs",
    "build_codec",
    "codec_config",
    "codec_config_class",
    "codec_option_names",
    "register_codec",
]

_CODECS: dict[str, tuple[type, type]] = {}


def register_codec(name: str, config_cls: type) -> Callable[[type], type]:
    """Class decorator registering ``codec_cls(config)`` under ``name``."""

    def wrap(codec_cls: type) -> type:
        if name in _CODECS and _CODECS[name][1] is not codec_cls:
            raise ValueError(f"codec {name!r} is already registered")
        codec_cls.name = name
        _CODECS[name] = (config_cls, codec_cls)
        return codec_cls

    return wrap


def available_codecs() -> list[str]:
    """Names accepted as ``codec=``."""
    return sorted(_CODECS)


def codec_config_class(name: str) -> type:
    """The config dataclass of codec ``name``; ``ValueError`` for an unknown name."""
    if name not in _CODECS:
        raise ValueError(f"codec={name!r} is unknown; allowed values: {available_codecs()}")
    return _CODECS[name][0]


def codec_option_names(name: str) -> tuple[str, ...]:
    """The options codec ``name`` declares: the fields of its config dataclass."""
    return tuple(f.name for f in dataclasses.fields(codec_config_class(name)))


def codec_config(name: str, options: dict[str, Any] | Any | None = None) -> Any:
    """The validated config of codec ``name`` from a config instance or a dict of its fields.

    Raises:
        ValueError: unknown codec, an option the codec does not take or a bad value.
    """
    config_cls = codec_config_class(name)
    if isinstance(options, config_cls):
        return options
    options = dict(options or {})
    allowed = codec_option_names(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"codec {name!r} does not take {unknown}; its options are {sorted(allowed)}"
        )
    return config_cls(**options)


def build_codec(name: str, options: dict[str, Any] | Any | None = None) -> Codec:
    """Codec ``name`` built from a config instance or a dict of its fields.

    Raises:
        ValueError: unknown codec, or an option the codec does not take.
    """
    return _CODECS[name][1](codec_config(name, options))
