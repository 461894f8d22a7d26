"""Reductions whose backward finds the reduced elements by comparing values.

``amax``, ``amin``, ``max()`` and ``min()`` over the whole tensor, ``median()``,
``nanmedian()`` and the ∞-norms save their input and their result, and their backward
routes the gradient to the input elements *equal* to the result (``amax``'s backward is
``grad · (x == result) / count``). Compressed apart, the decoded input holds no element
equal to the decoded (or kept) result: the count is 0 and the gradient NaN. A hand-written
stable softmax (``s - s.amax(-1, keepdim=True)``) gave NaN query and key gradients under
4-bit quantization.

So the engine never stores such a result: it is recomputed at unpack from the values its
input's holder unpacks (:func:`recompute_fn`), the same reduction of the same values,
so the comparison finds the maxima of what backward is given. Autograd saves the input
first and the result right after; the engine pairs them (the result's node takes the
input as its only input, and the reduction of that input equals the result).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["COMPARING_NODES", "recompute_fn"]

# autograd nodes of the reductions above (MaxBackward0/MinBackward0, with ``dim``, save
# indices instead and need nothing)
COMPARING_NODES = frozenset(
    {
        "AmaxBackward0",
        "AminBackward0",
        "MaxBackward1",
        "MinBackward1",
        "MedianBackward0",
        "NanmedianBackward0",
        "LinalgVectorNormBackward0",  # with ord ±inf only (its other orders do not compare)
    }
)


def _dims(saved: object) -> tuple[int, ...] | None:
    """A node's saved dims as ints (autograd returns negative ones as unsigned 64-bit)."""
    if saved is None:
        return None
    return tuple(d - 2**64 if d >= 2**63 else d for d in saved)  # type: ignore[attr-defined]


def _reduction(node: object) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The forward of ``node``'s reduction as a function of its input, or None."""
    name = type(node).__name__
    if name in ("AmaxBackward0", "AminBackward0"):
        op = torch.amax if name == "AmaxBackward0" else torch.amin
        dim, keepdim = _dims(node._saved_dim), bool(node._saved_keepdim)
        return lambda x: op(x, dim=dim, keepdim=keepdim)
    if name in ("MaxBackward1", "MinBackward1", "MedianBackward0", "NanmedianBackward0"):
        method = {"MaxBackward1": "max", "MinBackward1": "min", "MedianBackward0": "median"}
        attr = method.get(name, "nanmedian")
        return lambda x: getattr(x, attr)()
    if name == "LinalgVectorNormBackward0":
        order = float(node._saved_ord)
        if abs(order) != float("inf"):
            return None
        dim = _dims(node._saved_dim)
        keepdim = bool(node._saved_keepdim)
        return lambda x: torch.linalg.vector_norm(x, order, dim=dim, keepdim=keepdim)
    return None


def _is_input_of(node: object, source: torch.Tensor) -> bool:
    """Whether ``source`` is the one input of ``node`` (a graph edge to its node, or to the
    leaf it accumulates into)."""
    edges = node.next_functions  # type: ignore[attr-defined]
    if len(edges) != 1 or edges[0][0] is None:
        return False
    nxt = edges[0][0]
    if source.grad_fn is not None:
        return nxt is source.grad_fn
    return getattr(nxt, "variable", None) is source


def recompute_fn(
    result: torch.Tensor, source: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For the saved ``result`` of a reduction in :data:`COMPARING_NODES` whose input is
    ``source``: the function that makes ``result`` from that input's values; None if
    ``result`` is not such a result, or not ``source``'s.

    Example:
        >>> x = torch.randn(4, 6, requires_grad=True)
        >>> h = x * 2
        >>> r = h.amax(dim=1, keepdim=True)
        >>> fn = recompute_fn(r, h)
        >>> torch.equal(fn(h.detach()), r.detach()), recompute_fn(r, x)
        (True, None)
    """
    node = result.grad_fn
    if node is None or source is None or type(node).__name__ not in COMPARING_NODES:
        return None
    fn = _reduction(node)
    if fn is None or not _is_input_of(node, source):
        return None
    with torch.no_grad():
        again = fn(source.detach())
    exact = again.shape == result.shape and again.dtype == result.dtype
    if not (exact and torch.equal(again, result.detach())):
        return None  # e.g. NaN in the result (never equal to itself): keep the result
    return fn
