"""Policy registry: ``policy="fixed" | "off" | ...`` picks a class by name, and the one
place where flat keyword options are routed, by what each policy and codec declares."""

from __future__ import annotations

from typing import Any

from lightning_acgc.codecs.registry import available_codecs, codec_config_class, codec_option_names
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.policies.base import Policy

__all__ = [
    "accepted_codecs",
    "available_policies",
    "build_policy",
    "policy_class",
    "policy_option_names",
    "register_policy",
]

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


def accepted_codecs(cls: type[Policy]) -> list[str]:
    """The codecs policy ``cls`` accepts as ``codec=`` (its default first)."""
    return available_codecs() if cls.codecs is None else list(cls.codecs)


def policy_option_names(cls: type[Policy], codec: str | None = None) -> list[str]:
    """Every flat option policy ``cls`` takes: its own, ``codec`` if it takes one, and the
    options of ``codec`` (default: its default codec) if the user sets those."""
    names = set(cls.options)
    if cls.codecs != ():
        names.add("codec")
        if cls.takes_codec_options:
            names.update(codec_option_names(codec or accepted_codecs(cls)[0]))
    return sorted(names)


def build_policy(name: str, *, backend: str = "auto", **options: Any) -> Policy:
    """Policy ``name`` from flat options, routed by what the policy and codec declare.

    The policy's own ``options`` go to its constructor; ``codec`` (one of its
    ``codecs``) and, for a policy that ``takes_codec_options``, that codec's options form
    the :class:`~lightning_acgc.codecs.CodecSpec` passed as ``config``.

    Raises:
        ValueError: unknown policy, a codec the policy does not accept, an option
            neither the policy nor (where it takes them) its codec declares, or a bad
            value; the message names the policy and what it accepts.

    Example:
        >>> build_policy("fixed", codec="quant", bits=4).codec.config.bits
        4
        >>> build_policy("acgc", codec="division")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: policy 'acgc' chooses its own codec settings and takes codec in [...], not ...'
        >>> build_policy("off", bits=2)
        Traceback (most recent call last):
        ...
        ValueError: policy 'off' does not take ['bits']; its options are []
    """
    cls = policy_class(name)
    own = {k: options.pop(k) for k in list(options) if k in cls.options}
    if cls.codecs == ():
        if options:
            raise ValueError(
                f"policy {name!r} does not take {sorted(options)}; "
                f"its options are {policy_option_names(cls)}"
            )
        return cls(**own)
    accepted = accepted_codecs(cls)
    codec = options.pop("codec", accepted[0])
    if codec not in accepted:
        if cls.codecs is None:
            codec_config_class(codec)  # unknown codec: the codec registry's message
        raise ValueError(
            f"policy {name!r} chooses its own codec settings and takes codec in {accepted}, "
            f"not codec={codec!r}"
        )
    unknown = sorted(set(options) - set(policy_option_names(cls, codec)))
    if unknown:
        with_codec = f" with codec {codec!r}" if cls.takes_codec_options else ""
        raise ValueError(
            f"policy {name!r}{with_codec} does not take {unknown}; "
            f"its options are {policy_option_names(cls, codec)}"
        )
    own["config"] = CodecSpec(codec, options, backend)
    return cls(**own)
