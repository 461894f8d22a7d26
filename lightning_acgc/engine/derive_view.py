"""A saved view of a tensor saved just before it, in another shape: remade as that view
of what the first one's holder unpacks.

An eager attention's probabilities ``p`` are saved by their softmax (4-D) and, where no
dropout makes a new tensor of them (dropout 0, as Llama's, Mistral's and most language
models' pretraining), by the ``p·v`` product as the 3-D view its batched matmul takes:
one storage, two shapes, packed twice (the exact-view dedup keys on the shape); so is a
fused attention's output (``scaled_dot_product_attention`` keeps it for its backward) and
its (batch, seq, heads·dim) view that the output projection saves. With
``acgc`` the second is stored as nothing and made at unpack as the same view of the
first's decoded values: the two backward reads then see one rounding, charged once.
Likewise a dtype cast of a tensor saved just before it (:func:`cast_plan`: Llama casts
its float32 softmax back to bf16 for ``p·v`` under autocast) is cast again at unpack.

Example:
    >>> p = torch.softmax(torch.randn(2, 3, 4, 4, requires_grad=True), -1)
    >>> t = p.reshape(6, 4, 4)
    >>> plan = view_plan(t, [None, p])
    >>> plan.sources, plan.name, torch.equal(plan.fn(p.detach()), t.detach())
    ((1,), 'view', True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_acgc.engine.derive_cast import CAST_NODE, Unsaved, cast_output
from lightning_acgc.engine.derive_graph import Derivation, Origin, dense_order, find, placed

__all__ = ["cast_plan", "is_cast", "view_plan"]


def view_plan(
    saved: torch.Tensor,
    held: list[torch.Tensor | None],
    current: Callable[[int, torch.Tensor], bool] = lambda i, u: True,
) -> Derivation | None:
    """How to remake ``saved``, a view, as a view of one of ``held`` (the tensors saved
    just before it, oldest first; None where freed): one of the same storage, dense
    (contiguous, or in another order of its dimensions: a fused attention's output,
    whose (batch, seq, heads·dim) view the output projection saves), of the same dtype,
    whose elements hold all of ``saved``'s, and whose holder holds its values now
    (``current(i, u)``: saved at the storage's present version; views share one version
    counter, so only the engine, which keyed each save by its version, can tell an
    in-place change since); None where there is none."""
    base = saved._base
    if base is None or not saved.numel() or any(s < 0 for s in saved.stride()):
        return None
    reach = sum((n - 1) * s for n, s in zip(saved.shape, saved.stride(), strict=True))
    for i in range(len(held) - 1, -1, -1):
        u = held[i]
        if u is None or u is saved or (u is not base and u._base is not base):
            continue
        dense = u.is_contiguous() or dense_order(u) is not None
        if u.dtype != saved.dtype or not dense or not current(i, u):
            continue
        start = saved.storage_offset() - u.storage_offset()
        if start < 0 or start + reach >= u.numel():
            continue
        return Derivation(placed(saved, u), (i,), "view", _one)
    return None


def cast_plan(saved: torch.Tensor, recent: list[Origin]) -> Derivation | None:
    """How to remake ``saved`` (a view of ``base``), a dtype cast of a tensor saved just
    before it (autocast's bf16 copy of the float32 probabilities a softmax saved, for
    the product after it), as that cast of what the first one's holder unpacks
    (:func:`~lightning_acgc.engine.derive_cast.cast_output`, its input taken as saved);
    None where its input is not among ``recent`` (oldest first)."""
    base = saved if saved._base is None else saved._base
    if not is_cast(base):
        return None
    plan = cast_output(saved, base, recent, _saved_before)
    return None if plan is None else plan._replace(name=plan.name.removesuffix(" of saved"))


def _saved_before(like: Unsaved, recent: list[Origin]) -> Derivation | None:
    """The cast's input as it is, where it is among ``recent`` (not a parameter: its
    copy is cast again from the parameter itself, engine/param_casts.py)."""
    i = find(recent, (like.grad_fn, like.output_nr), like)  # type: ignore[arg-type]
    if i is None or recent[i].leaf is not None:
        return None
    return Derivation(_as_is, (i,), "saved", _one)


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def is_cast(t: torch.Tensor) -> bool:
    """A cheap test: ``t`` (or its base) is a floating dtype cast with autograd history."""
    base = t if t._base is None else t._base
    return type(base.grad_fn).__name__ == CAST_NODE and base.is_floating_point()


def _one(*_: object) -> float:
    return 1.0  # the same values: the source's rounding, unchanged
