"""The compression config's target: :class:`lightning_acgc.ActivationCompression`."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

__all__ = ["activation_compression"]


def activation_compression(policy: str, **options: Any) -> Callback:
    """``lightning_acgc.ActivationCompression(policy, **options)``, leaving out options
    set to ``None`` (``null`` in a config: "the policy's own default").

    One compression config can thus list the options of several codecs (``bits`` for
    ``quant``, ``error_bound`` for ``bounded``) and pass only those that are set.

    Args:
        policy: a registered policy name (``lightning_acgc.policies.available_policies()``).
        **options: the callback's arguments and the policy's and codec's options.

    Returns:
        The callback, its arguments checked.

    Raises:
        ValueError: the policy is not available in this install, or a bad option (the
            callback's own message).
        ImportError: this install of ``lightning_acgc`` has no Lightning callback yet.

    Example:
        >>> activation_compression("no-such-policy")
        Traceback (most recent call last):
        ...
        ValueError: compression policy 'no-such-policy' is not available ...
    """
    from lightning_acgc.policies import available_policies

    if policy not in available_policies():
        raise ValueError(
            f"compression policy {policy!r} is not available in this install of "
            f"lightning_acgc (available: {', '.join(available_policies())}); pick another "
            f"compression config, e.g. compression=fixed, or compression=none for none"
        )
    try:
        from lightning_acgc import ActivationCompression
    except ImportError as err:
        raise ImportError(
            "this install of lightning_acgc has no Lightning callback "
            "(lightning_acgc.ActivationCompression); train without compression: compression=none"
        ) from err
    return ActivationCompression(policy, **{k: v for k, v in options.items() if v is not None})
