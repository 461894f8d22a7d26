"""Per-module gradient tables of the AC-GC policy, and their average over ranks."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_acgc.kernels.common.sums import dense, squared_sum
from lightning_acgc.policies.base import Reduce

__all__ = ["finite", "module_norms", "per_module_sq", "per_module_sq_diff", "reduce_tables"]


def module_of(name: str) -> str:
    """The module a parameter's gradient is read under: the name without its last part;
    a parametrization's originals (``weight_norm``'s g and v, ``spectral_norm``'s weight)
    under the module whose weight they make, the weight op the error model charges.

    Example:
        >>> module_of("net.2.bias"), module_of("net.2.parametrizations.weight.original0")
        ('net.2', 'net.2')
    """
    owner, marker, _ = name.partition(".parametrizations.")
    return owner if marker else name.rpartition(".")[0]


def per_module_sq(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Squared norm of the gradients by module (a parameter name without its last part)."""
    out: dict[str, float] = {}
    for name, g in grads.items():
        module = module_of(name)
        out[module] = out.get(module, 0.0) + squared_sum(g)
    return out


def per_module_sq_diff(
    grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> dict[str, float]:
    """‖a − b‖² by module over the parameters both tables hold, one parameter at a time
    (a table of every difference held a second copy of the model's gradients, and took a
    tenth of a BERT-base probe), in one pass with no difference tensor for float32 on the
    CPU (:func:`~lightning_acgc.kernels.common.sums.squared_sum`). Each difference is
    taken in ``grads``' dtype: exact
    where the two are within 2x of each other (Sterbenz), within half an ulp of itself
    elsewhere.

    Example:
        >>> a = {"fc.weight": torch.tensor([1.0, 2.0]), "fc.bias": torch.tensor([1.0])}
        >>> per_module_sq_diff(a, {"fc.weight": torch.tensor([1.0, 0.0])})
        {'fc': 4.0}
    """
    out: dict[str, float] = {}
    for name, ref in reference.items():
        if name in grads:
            module = module_of(name)
            out[module] = out.get(module, 0.0) + squared_sum(grads[name], ref)
    return out


def finite(*tables: dict[str, float]) -> bool:
    """Whether every value of the tables is finite. A calibration whose gradients are not
    (fp16 training's GradScaler lets a step overflow to inf, then skips it) is not read.

    Example:
        >>> finite({"a": 1.0}, {"b": 0.0}), finite({"a": float("inf")}), finite({"a": float("nan")})
        (True, False, False)
    """
    return all(math.isfinite(v) for table in tables for v in table.values())


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
    model: nn.Module,
    exact: dict[str, torch.Tensor] | None,
    exact_sq: dict[str, float] | None = None,
    compressed: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Per module owning parameters: ‖g_m‖² of the reference gradient (the exact one,
    else the compressed one) and ‖ĝ_m − g_m‖² (0 without an exact gradient). Every
    module of ``model`` with parameters has an entry, so the keys match across ranks.
    ``exact_sq``: ``per_module_sq(exact)`` where the caller has it (not computed twice).
    ``compressed``: ĝ by parameter name, read in place of ``p.grad`` (an accumulated
    step's, as :class:`~lightning_acgc.engine.last_batch.LastBatch` reads it)."""
    g_sq: dict[str, float] = {}
    err_sq: dict[str, float] = {}
    compared: set[str] = set()  # modules with a parameter held against the exact gradient
    for name, p in model.named_parameters():
        module = module_of(name)
        g_sq.setdefault(module, 0.0)
        err_sq.setdefault(module, 0.0)
        held = p.grad if compressed is None else compressed.get(name)
        if held is None:
            continue
        got = dense(held.detach())
        ref = exact.get(name) if exact is not None else None
        if ref is None:
            g_sq[module] += squared_sum(got)
            continue
        if exact_sq is None:
            g_sq[module] += squared_sum(ref)
        compared.add(module)
        err_sq[module] += squared_sum(got, ref)  # as per_module_sq_diff
    for module in compared if exact_sq is not None else ():
        g_sq[module] += exact_sq.get(module, 0.0)
    return g_sq, err_sq
