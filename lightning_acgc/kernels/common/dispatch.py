"""The one backend router of every kernel family: Triton, the compiled CPU path, or the
pure-torch reference."""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

import torch

from lightning_acgc.kernels.common.cpu_lib import cpu_library

__all__ = ["BACKENDS", "route", "triton_available", "use_triton"]

BACKENDS = ("auto", "torch", "triton", "cpu")


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available(device: torch.device) -> bool:
    """Triton can run on ``device``: CUDA with triton installed, or any device under
    ``TRITON_INTERPRET=1``."""
    if not _triton_importable():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed; allowed values: {list(BACKENDS)}")


def use_triton(x: torch.Tensor, backend: str) -> bool:
    """Whether ``x`` goes through Triton under ``backend`` (one of :data:`BACKENDS`).

    Raises:
        RuntimeError: ``backend="triton"`` where Triton cannot run.
        ValueError: an unknown ``backend``.
    """
    _check_backend(backend)
    if backend in ("torch", "cpu"):
        return False
    if backend == "auto":
        return x.device.type == "cuda" and _triton_importable()
    if not triton_available(x.device):
        raise RuntimeError(
            f"backend='triton' cannot run on a {x.device.type} tensor: Triton needs a CUDA "
            "device, or TRITON_INTERPRET=1 set before triton is imported (CPU testing). "
            "Use backend='auto' or 'torch'."
        )
    return True


def route(
    x: torch.Tensor,
    backend: str,
    reference: Callable[..., Any],
    triton: str | None,
    cpu: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """The function that handles ``x`` under ``backend``.

    ``auto`` picks Triton for CUDA tensors, the compiled CPU path ``cpu`` for CPU tensors
    (when given and the library could be built), else the ``reference``. ``torch`` always
    picks the reference; ``triton`` and ``cpu`` force a path.

    Args:
        x: the tensor (or a payload tensor) that decides the device.
        backend: one of :data:`BACKENDS`.
        reference: the pure-torch function.
        triton: ``"module:function"`` of the Triton launcher, imported on first use; None
            where the family has none (CUDA tensors, and ``backend="triton"``, then take
            the reference's torch ops).
        cpu: the compiled CPU function, or None where the family has none.

    Raises:
        RuntimeError: a forced backend that cannot run on ``x``.
        ValueError: an unknown ``backend``.

    Example:
        >>> ref = lambda t: "reference"
        >>> route(torch.ones(2), "torch", ref, "math:sqrt")(None)
        'reference'
    """
    if triton is None:
        _check_backend(backend)
        if backend == "triton":
            return reference
    elif use_triton(x, backend):
        module, name = triton.split(":")
        return getattr(importlib.import_module(module), name)
    if backend == "torch" or cpu is None or x.device.type != "cpu":
        if backend == "cpu" and (cpu is None or x.device.type != "cpu"):
            raise RuntimeError(f"backend='cpu' has no compiled path for a {x.device} tensor here")
        return reference
    if cpu_library() is None:
        if backend == "cpu":
            raise RuntimeError("backend='cpu' needs the compiled CPU library, which is missing")
        return reference
    return cpu
