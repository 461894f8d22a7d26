"""Per-module gradient tables of the AC-GC policy, and their average over ranks."""

from __future__ import annotations

import torch
from torch import nn

from lightning_acgc.policies.base import Reduce

__all__ = ["module_norms", "per_module_sq", "reduce_tables"]


def per_module_sq(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Squared norm of the gradients by module (a parameter name without its last part)."""
    out: dict[str, float] = {}
    for name, g in grads.items():
        module = name.rpartition(".")[0]
        out[module] = out.get(module, 0.0) + float(g.detach().double().square().sum())
    return out


def reduce_tables(reduce: Reduce | None, *tables: dict[str, float]) -> list[dict[str, float]]:
    """Average tables over ranks, so every rank gets the same settings. Each table's keys
    must be the same on every rank (module names, site keys, a fixed key)."""
    if reduce is None:
        return list(tables)
    keys = [sorted(t) for t in tables]
    values = [t[k] for t, ks in zip(tables, keys, strict=True) for k in ks]
    if not values:
        return list(tables)
    vec = reduce(torch.tensor(values, dtype=torch.float64)).tolist()
    out, start = [], 0
    for ks in keys:
        out.append(dict(zip(ks, vec[start : start + len(ks)], strict=True)))
        start += len(ks)
    return out


def module_norms(
    model: nn.Module, exact: dict[str, torch.Tensor] | None
) -> tuple[dict[str, float], dict[str, float]]:
    """Per module owning parameters: ‖g_m‖² of the reference gradient (the exact one,
    else the compressed one) and ‖ĝ_m − g_m‖² (0 without an exact gradient). Every
    module of ``model`` with parameters has an entry, so the keys match across ranks."""
    g_sq: dict[str, float] = {}
    err_sq: dict[str, float] = {}
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        g_sq.setdefault(module, 0.0)
        err_sq.setdefault(module, 0.0)
        if p.grad is None:
            continue
        got = p.grad.detach().double()
        ref = exact.get(name) if exact is not None else None
        if ref is None:
            g_sq[module] += float(got.square().sum())
        else:
            ref = ref.double()
            g_sq[module] += float(ref.square().sum())
            err_sq[module] += float((got - ref).square().sum())
    return g_sq, err_sq
