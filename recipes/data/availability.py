"""Whether a real data set can be had, and the fallback to the offline default if not.

Real loaders never hang: the network is probed with a short TCP connect first, and
``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1`` or ``ACGC_OFFLINE=1`` skip the probe
(the loaders then use local files only).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_warn

__all__ = [
    "DataUnavailableError",
    "data_root",
    "fall_back_or_raise",
    "hf_cache_only",
    "network_problem",
    "offline",
]

_HF_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_OFFLINE_VARS = ("ACGC_OFFLINE", *_HF_OFFLINE_VARS)


class DataUnavailableError(RuntimeError):
    """A real data set is not available here and falling back is switched off."""


def _set(names: tuple[str, ...]) -> list[str]:
    return [v for v in names if os.environ.get(v, "").lower() in ("1", "true", "yes")]


def offline() -> bool:
    """True when the environment asks for no network access (see module docstring)."""
    return bool(_set(_OFFLINE_VARS))


def hf_cache_only() -> bool:
    """True when Hugging Face libraries are told to use their local caches only."""
    return bool(_set(_HF_OFFLINE_VARS))


def network_problem(host: str, port: int = 443, timeout_s: float = 3.0) -> str | None:
    """Why ``host`` cannot be used for a download, or ``None`` if it answers.

    No connection is tried when :func:`offline` is true; otherwise a TCP connection to
    ``host:port`` must open within ``timeout_s`` seconds.
    """
    if offline():
        return f"network access is switched off ({', '.join(_set(_OFFLINE_VARS))} set)"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError:
        return f"{host} did not answer within {timeout_s:g} s"


def data_root(root: str) -> Path:
    """``root`` with ``~`` expanded, created if missing."""
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def fall_back_or_raise(requested: str, reason: str, offline_default: str, fallback: bool) -> None:
    """Warn that ``offline_default`` replaces ``requested``, or raise if ``fallback`` is off.

    Args:
        requested: the data set asked for, e.g. ``"CIFAR-10"``.
        reason: why it is not available, e.g. ``"torchvision is not installed"``.
        offline_default: the config that works offline, e.g. ``"data=digits"``.
        fallback: warn and go on (``True``) or raise (``False``).

    Raises:
        DataUnavailableError: when ``fallback`` is false.
    """
    message = f"{requested} is not available: {reason}."
    if not fallback:
        raise DataUnavailableError(
            f"{message} Use the offline default instead ({offline_default}), or set "
            f"data.fallback=true to switch to it automatically."
        )
    rank_zero_warn(
        f"{message} Training on the offline default ({offline_default}) instead; "
        f"set data.fallback=false to make this an error."
    )
