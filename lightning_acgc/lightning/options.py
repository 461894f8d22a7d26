"""What ``ActivationCompression``'s arguments become: the policy, built by name from the
flat options each policy and codec declares (routed by
:func:`lightning_acgc.policies.build_policy`), and its text for logs and tables."""

from __future__ import annotations

from typing import Any

from lightning_acgc.codecs import CodecSpec, codec_option_names
from lightning_acgc.lightning.batch_size import CompressedBatchSizeFinder
from lightning_acgc.policies import Policy, build_policy

__all__ = [
    "CODEC_POLICY",
    "DEFAULT_POLICY",
    "DEFAULT_POLICY_OPTIONS",
    "codec_text",
    "make_finder",
    "make_policy",
    "policy_text",
]

# The default policy and, when no codec is named, its default options: the one place to
# change when another policy becomes the default.
# Without ``policy``: the adaptive AC-GC policy; naming a codec or its options instead
# (``ActivationCompression(codec="quant", bits=2)``) means that codec everywhere.
DEFAULT_POLICY = "acgc"
CODEC_POLICY = "fixed"
DEFAULT_POLICY_OPTIONS: dict[str, dict[str, Any]] = {"fixed": {"codec": "quant", "bits": 4}}


def make_policy(policy: str | Policy | None, backend: str, options: dict[str, Any]) -> Policy:
    """The policy ``ActivationCompression(policy, backend=..., **options)`` uses.

    An option set to ``None`` is left out: the policy's or codec's own default (so one
    config can list the options of several codecs, ``null`` where unused).

    Example:
        >>> make_policy(None, "auto", {"bits": 2, "error_bound": None}).config.describe()
        'codec=quant bits=2'
    """
    options = {k: v for k, v in options.items() if v is not None}
    if policy is None:
        default = DEFAULT_POLICY_OPTIONS[CODEC_POLICY]["codec"]
        names_codec = options.keys() & {"codec", *codec_option_names(default)}
        policy = CODEC_POLICY if names_codec else DEFAULT_POLICY
    if isinstance(policy, Policy):
        if options:
            raise ValueError(
                f"options {sorted(options)} configure a policy by name; a Policy instance "
                "is already configured, so give them to its constructor"
            )
        return policy
    if not isinstance(policy, str):
        raise ValueError(f"policy={policy!r} must be a policy name or a Policy instance")
    if "codec" not in options:
        options = {**DEFAULT_POLICY_OPTIONS.get(policy, {}), **options}
    return build_policy(policy, backend=backend, **options)


def codec_text(policy: Policy) -> str:
    """``"codec=quant bits=4"``: the policy's codec spec (or ``""``)."""
    config = getattr(policy, "config", None)
    return config.describe() if isinstance(config, CodecSpec) else ""


def policy_text(policy: Policy) -> str:
    """:func:`_codec_text` plus the policy's declared options (kept as attributes of the
    same name), e.g. ``"acgc codec=bounded gradient_error=0.05"``."""
    parts = [policy.name, codec_text(policy)]
    for name in policy.options:
        value = getattr(policy, name, None)
        if isinstance(value, (bool, int, float, str)):
            parts.append(f"{name}={value}")
    return " ".join(p for p in parts if p)


def make_finder(
    scale_batch_size: str | CompressedBatchSizeFinder | None,
    lr_scaling: str | None,
    enabled: bool,
) -> CompressedBatchSizeFinder | None:
    """The batch-size search ``scale_batch_size`` and ``lr_scaling`` ask for (``None``:
    none); ``enabled`` is False for the ``off`` policy, which cannot search.

    Example:
        >>> make_finder("power", "sqrt", True).lr_scaling, make_finder(None, None, True)
        ('sqrt', None)
    """
    if scale_batch_size is None:
        if lr_scaling is not None:
            raise ValueError(
                f"lr_scaling={lr_scaling!r} applies to a batch-size search; "
                "set scale_batch_size='binsearch' or 'power' too"
            )
        return None
    if not enabled:
        raise ValueError(
            "scale_batch_size needs compression, but policy='off' installs nothing; "
            "use Lightning's BatchSizeFinder for an uncompressed search"
        )
    if isinstance(scale_batch_size, CompressedBatchSizeFinder):
        if lr_scaling is not None:
            if scale_batch_size.lr_scaling not in (None, lr_scaling):
                raise ValueError(
                    f"lr_scaling={lr_scaling!r} differs from the finder's "
                    f"{scale_batch_size.lr_scaling!r}; give it in one place"
                )
            scale_batch_size.lr_scaling = lr_scaling
        finder = scale_batch_size
    elif isinstance(scale_batch_size, str):
        finder = CompressedBatchSizeFinder(scale_batch_size, lr_scaling=lr_scaling)
    else:
        raise ValueError(
            f"scale_batch_size={scale_batch_size!r} must be 'power', 'binsearch', "
            "a CompressedBatchSizeFinder or None"
        )
    finder._owned = True
    return finder
