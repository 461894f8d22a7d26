"""Choosing between the Triton kernels and the pure-torch reference."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["triton_available", "use_triton"]


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


def use_triton(x: torch.Tensor, backend: str) -> bool:
    """Whether ``x`` goes through Triton under ``backend`` ("auto", "torch", "triton").

    Raises:
        RuntimeError: ``backend="triton"`` where Triton cannot run.
    """
    if backend == "torch":
        return False
    if backend == "auto":
        return x.device.type == "cuda" and _triton_importable()
    if backend == "triton":
        if not triton_available(x.device):
            raise RuntimeError(
                f"backend='triton' cannot run on a {x.device.type} tensor: Triton needs a CUDA "
                "device, or TRITON_INTERPRET=1 set before triton is imported (CPU testing). "
                "Use backend='auto' or 'torch'."
            )
        return True
    raise ValueError(
        f"backend={backend!r} is not allowed; allowed values: ['auto', 'torch', 'triton']"
    )
