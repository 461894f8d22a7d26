"""Reductions whose backward finds the reduced elements by comparing values.

``amax``, ``amin``, ``max()`` and ``min()`` over the whole tensor, ``median()``,
``nanmedian()``, the ∞-norms, and ``scatter_reduce``/``index_reduce`` with ``amax`` or
``amin`` (a GNN's max aggregation) save their inputs and their result, and their backward
routes the gradient to the input elements *equal* to the result (``amax``'s backward is
``grad · (x == result) / count``). Compressed apart, the decoded input holds no element
equal to the decoded (or kept) result: the count is 0 and the gradient NaN. A hand-written
stable softmax (``s - s.amax(-1, keepdim=True)``) and a GraphSAGE with max aggregation
gave NaN gradients under 4-bit quantization.

So the engine never stores such a result: it is recomputed at unpack from the values its
inputs' holders unpack (:func:`recompute_plan`), the same reduction of the same values,
so the comparison finds the maxima of what backward is given. Autograd saves the inputs
first (``scatter_reduce``: index, self, src) and the result right after; the engine pairs
them: the inputs are the node's (by the graph's edges) and the reduction of them equals
the result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["COMPARING_NODES", "recompute_fn", "recompute_plan", "saved_dims"]

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
        "ScatterReduceBackward0",  # these two with reduce amax or amin only
        "IndexReduceBackward0",
    }
)
_SCATTERS = {"ScatterReduceBackward0": "scatter_reduce", "IndexReduceBackward0": "index_reduce"}


def saved_dims(saved: object) -> tuple[int, ...] | None:
    """A node's saved dims as ints (autograd returns negative ones as unsigned 64-bit)."""
    if saved is None:
        return None
    return tuple(d - 2**64 if d >= 2**63 else d for d in saved)  # type: ignore[attr-defined]


def _reduction(node: object) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The forward of ``node``'s reduction as a function of its input, or None."""
    name = type(node).__name__
    if name in ("AmaxBackward0", "AminBackward0"):
        op = torch.amax if name == "AmaxBackward0" else torch.amin
        dim, keepdim = saved_dims(node._saved_dim), bool(node._saved_keepdim)
        return lambda x: op(x, dim=dim, keepdim=keepdim)
    if name in ("MaxBackward1", "MinBackward1", "MedianBackward0", "NanmedianBackward0"):
        method = {"MaxBackward1": "max", "MinBackward1": "min", "MedianBackward0": "median"}
        attr = method.get(name, "nanmedian")
        return lambda x: getattr(x, attr)()
    if name == "LinalgVectorNormBackward0":
        order = float(node._saved_ord)
        if abs(order) != float("inf"):
            return None
        dim = saved_dims(node._saved_dim)
        keepdim = bool(node._saved_keepdim)
        return lambda x: torch.linalg.vector_norm(x, order, dim=dim, keepdim=keepdim)
    return None


def _reproduces(
    fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], result: torch.Tensor
) -> bool:
    """Whether ``fn`` of ``inputs`` is ``result``: equal values on the CPU; on a device,
    equal shape and dtype (from meta tensors: comparing values there would wait for the
    device at every such save; the graph's edges already name the inputs)."""
    with torch.no_grad():
        if result.device.type != "cpu":
            again = fn(*(t.detach().to("meta") for t in inputs))
            return again.shape == result.shape and again.dtype == result.dtype
        again = fn(*(t.detach() for t in inputs))
    same = again.shape == result.shape and again.dtype == result.dtype
    return same and torch.equal(again, result.detach())


def _comes_from(edge: tuple[object, int], source: torch.Tensor) -> bool:
    """Whether the graph ``edge`` (a node's entry of ``next_functions``) leads to
    ``source``: to its node, or to the leaf it accumulates into."""
    nxt = edge[0]
    if nxt is None:
        return False
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
    fn, edges = _reduction(node), node.next_functions
    if fn is None or len(edges) != 1 or not _comes_from(edges[0], source):
        return None
    if not _reproduces(fn, (source,), result):
        return None  # e.g. NaN in the result (never equal to itself): keep the result
    return fn


def _scatter(node: object) -> Callable[..., torch.Tensor] | None:
    """``(index, self, src) -> result`` of a scatter or index reduction by amax or amin."""
    reduce = node._saved_reduce  # type: ignore[attr-defined]
    if reduce not in ("amax", "amin"):
        return None
    method, dim = _SCATTERS[type(node).__name__], int(node._saved_dim)  # type: ignore[attr-defined]
    include_self = bool(node._saved_include_self)  # type: ignore[attr-defined]

    def fn(index: torch.Tensor, values: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return getattr(values, method)(dim, index, src, reduce, include_self=include_self)

    return fn


def recompute_plan(
    result: torch.Tensor, recent: list[torch.Tensor | None]
) -> tuple[Callable[..., torch.Tensor], int] | None:
    """``(fn, k)``: ``result``, the output of a reduction in :data:`COMPARING_NODES`, is
    ``fn`` of the last ``k`` tensors saved before it (``recent``, oldest first; None for
    one no longer alive); None where it is not such a result or they are not its inputs.

    Example:
        >>> src = torch.randn(6, 2, requires_grad=True) * 1
        >>> index = torch.tensor([0, 1, 0, 1, 0, 1])[:, None].expand(6, 2)
        >>> start = torch.zeros(2, 2)
        >>> out = start.scatter_reduce(0, index, src, "amax")
        >>> fn, k = recompute_plan(out, [index, start, src])
        >>> k, torch.equal(fn(index, start, src.detach()), out.detach())
        (3, True)
    """
    node = result.grad_fn
    if node is None or type(node).__name__ not in _SCATTERS:
        fn = recompute_fn(result, recent[-1] if recent else None)
        return None if fn is None else (fn, 1)
    fn = _scatter(node)
    if fn is None or len(recent) < 3 or any(t is None for t in recent[-3:]):
        return None
    index, values, src = recent[-3:]
    if index.is_floating_point() or not _comes_from(node.next_functions[-1], src):
        return None
    if not _reproduces(fn, (index, values, src), result):
        return None
    return fn, 3
