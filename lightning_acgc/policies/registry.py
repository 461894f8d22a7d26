"""Policy registry: ``policy="fixed" | "off" | ...`` picks a class by name."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from lightning_acgc.config import CompressionConfig
from lightning_acgc.policies.base import Policy

__all__ = ["available_policies", "build_policy", "policy_class", "register_policy"]

_POLICIES: dict[str, type[Policy]] = {}


def register_policy(name: str, cls: type[Policy]) -> None:
    _POLICIES[name] = cls


def available_policies() -> list[str]:
    return sorted(_POLICIES)


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name``; ``ValueError`` for an unknown name."""
    if name not in _POLICIES:
        raise ValueError(f"policy={name!r} is unknown; allowed values: {available_policies()}")
    return _POLICIES[name]


def build_policy(name: str, **options: Any) -> Policy:
    """Policy ``name`` from flat options.

    Options the policy's constructor names are passed to it; the rest form its
    :class:`CompressionConfig` (engine fields and codec options), passed as ``config``.

    Raises:
        ValueError: unknown policy or a bad option.

    Example:
        >>> build_policy("fixed", codec="quant", bits=4).codec.config.bits
        4
    """
    cls = policy_class(name)
    params = inspect.signature(cls.__init__).parameters
    own = {k: options.pop(k) for k in list(options) if k in params and k != "config"}
    if "config" in params:
        config_fields = {f.name for f in dataclasses.fields(CompressionConfig)}
        if "codec" not in options and getattr(cls, "default_codec", None):
            options["codec"] = cls.default_codec
        own["config"] = CompressionConfig.from_kwargs(
            **{k: v for k, v in options.items() if k in config_fields or k not in params}
        )
    elif options:
        raise ValueError(f"policy {name!r} does not take {sorted(options)}")
    return cls(**own)
