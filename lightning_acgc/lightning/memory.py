"""What a memory budget is measured against: parsing ``"2GB"``-style sizes, and the bytes
of parameters, gradients and optimizer state that live beside the saved activations."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

__all__ = ["parse_memory", "static_memory_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_memory(value: int | str | None, name: str = "memory_budget") -> int | None:
    """Bytes from an int or a text such as ``"2GB"`` (10⁹) or ``"512MiB"`` (2²⁰).

    Raises:
        ValueError: not a positive int, or text without a known unit
            (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).

    Example:
        >>> parse_memory("2GB"), parse_memory("1.5 KiB"), parse_memory(4096), parse_memory(None)
        (2000000000, 1536, 4096, None)
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a number of bytes or a text like '2GB'")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name}={value!r} must be > 0 bytes")
        return value
    if isinstance(value, str):
        match = _MEMORY.match(value)
        unit = match.group(2).lower() if match else None
        if match and unit in _UNITS:
            nbytes = int(float(match.group(1)) * _UNITS[unit])
            if nbytes > 0:
                return nbytes
    raise ValueError(
        f"{name}={value!r} must be a positive int of bytes or a text like '2GB' or '512MiB' "
        "(units: B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)"
    )


def _tensor_bytes(tensors: Any) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state; estimated from its type before the first step."""
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if state and sum(t.numel() for t in state) >= sum(p.numel() for p in params):
        return _tensor_bytes(state)
    name = type(optimizer).__name__
    defaults = optimizer.defaults
    if name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adadelta"):
        per_param = 2 + int(bool(defaults.get("amsgrad", False)))
    elif name == "RMSprop":
        per_param = 1 + int(defaults.get("momentum", 0) > 0) + int(bool(defaults.get("centered")))
    elif name in ("SGD", "Adagrad"):
        per_param = int(name == "Adagrad" or defaults.get("momentum", 0) > 0)
    else:
        per_param = 0
    return per_param * _tensor_bytes(params)


def static_memory_bytes(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes besides activations held during a step: parameters, buffers, gradients and
    optimizer state (estimated from the optimizer's type before its first step).

    Example:
        >>> model = nn.Linear(10, 10)  # 110 parameters of 4 bytes
        >>> static_memory_bytes(model, [torch.optim.Adam(model.parameters())])
        1760
    """
    resident = _tensor_bytes([*module.parameters(), *module.buffers()])
    grads = _tensor_bytes([p for p in module.parameters() if p.requires_grad])
    return resident + grads + sum(_optimizer_state_bytes(o) for o in optimizers)
