"""Rotary position embeddings, remade: a query or key rotated as Llama, Mistral, Qwen and
GPT-NeoX rotate them, ``q·cos + rotate_half(q)·sin``, saved by the attention after it,
remade at unpack from the projection's input (see :mod:`lightning_acgc.engine.derive`).

The attention saves its rotated queries and keys (a fused attention for its backward,
an eager one for ``q·kᵀ``): with the value projection remade as a Linear's output
(:mod:`~lightning_acgc.engine.derive_linear`), they were two of the five tensors of a
layer's width that acgc still stored on a Llama, at 8 bits (they enter the scores'
exponential). Here the rotation is read off the graph: an add of two products, one of
``q`` and a tensor without history (``cos``), one of ``cat(−q[..., h:], q[..., :h])``
and another (``sin``), ``q`` a Linear's product after layout steps. At unpack ``q`` is
made again from what the Linear's input's holder unpacks and rotated with what the
holders of ``cos`` and ``sin`` unpack (the two products saved them; which holders,
autograd is asked: :meth:`~lightning_acgc.engine.recompute.Recomputing._locator`).

The error reaches the result from three holders (``Derivation.roots``): the input's
rounding through the projection (:func:`~.derive_linear.linear_gain`) and the rotation
(``mean(cos²) + mean(sin²)``, 1 for a rotation), and ``cos``'s and ``sin``'s rounding
times ``mean(q²)``.

Example:
    >>> from lightning_acgc.engine.derive_graph import Origin
    >>> lin = torch.nn.Linear(8, 8, bias=False)
    >>> x = torch.randn(6, 8, requires_grad=True) * 1.0
    >>> angle = torch.rand(6, 1) * 6
    >>> cos, sin = angle.cos().repeat(1, 8), angle.sin().repeat(1, 8)
    >>> q = lin(x)
    >>> r = q * cos + torch.cat((-q[..., 4:], q[..., :4]), -1) * sin
    >>> locate = {"_saved_other": [1, 2]}
    >>> plan = rotary_output(r, r, [Origin.of(x), Origin.of(cos), Origin.of(sin)],
    ...                      lambda node, attr: locate[attr].pop(0))
    >>> plan.name, plan.sources, torch.equal(plan.fn(x.detach(), cos, sin), r.detach())
    ('rotary of linear', (0, 1, 2), True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_acgc.engine.derive_batch_norm import ADD_NODE
from lightning_acgc.engine.derive_cast import CAST_NODE, SOURCE_DTYPES, Unsaved
from lightning_acgc.engine.derive_dropout import MUL_NODE
from lightning_acgc.engine.derive_graph import (
    Derivation,
    Origin,
    dense_order,
    mean_square,
    placed,
)
from lightning_acgc.engine.derive_linear import linear_output
from lightning_acgc.engine.layout_chain import layout_chain, node_int

__all__ = ["rotary", "rotary_output"]

# (node, "_saved_self" or "_saved_other") -> the position in ``recent`` of the holder
# autograd keeps for it, or None
Locate = Callable[[object, str], "int | None"]


def rotary(base: torch.Tensor) -> bool:
    """A cheap test: ``base`` is a sum of two products (the rotation's form), or layout
    steps of one, or a cast of either."""
    if layout_chain(base, _is_rotation) is not None:
        return True
    node = base.grad_fn
    if type(node).__name__ != CAST_NODE or not base.is_floating_point():
        return False
    ((inner, slot),) = node.next_functions  # type: ignore[union-attr]
    like = Unsaved(inner, base.shape, base.dtype, base.device, slot)
    return layout_chain(like, _is_rotation) is not None  # type: ignore[arg-type]


def _is_rotation(node: object) -> bool:
    if type(node).__name__ != ADD_NODE or float(getattr(node, "_saved_alpha", 0)) != 1:
        return False
    edges = node.next_functions  # type: ignore[attr-defined]
    return len(edges) == 2 and all(type(e[0]).__name__ == MUL_NODE for e in edges)


def _factor(mul: object) -> tuple[tuple[object, int], str] | None:
    """The edge of the product's one factor with history and the attribute under which
    the product saved the other (which has none)."""
    (a, i), (b, j) = mul.next_functions  # type: ignore[attr-defined]
    if a is not None and b is None:
        return (a, i), "_saved_other"
    if b is not None and a is None:
        return (b, j), "_saved_self"
    return None


def _halves(cat: object, q: tuple[object, int], shape: torch.Size) -> bool:
    """Whether ``cat`` is ``cat(−q[..., h:], q[..., :h], dim=-1)`` of the edge ``q``, of
    ``shape`` (h: half its last dimension)."""
    size, ndim = shape[-1], len(shape)
    if type(cat).__name__ != "CatBackward0" or size % 2:
        return False
    edges = cat.next_functions  # type: ignore[attr-defined]
    dim = node_int(cat._saved_dim) % ndim  # type: ignore[attr-defined]
    if len(edges) != 2 or dim != ndim - 1 or type(edges[0][0]).__name__ != "NegBackward0":
        return False
    half = size // 2
    first = edges[0][0].next_functions[0]
    return _slice_of(first, q, half, size) and _slice_of(edges[1], q, 0, half)


def _slice_of(edge: tuple[object, int], q: tuple[object, int], start: int, end: int) -> bool:
    node = edge[0]
    if type(node).__name__ != "SliceBackward0" or node.next_functions[0] != q:  # type: ignore[union-attr]
        return False
    sizes = node._saved_self_sym_sizes  # type: ignore[union-attr]
    dim = node_int(node._saved_dim) % len(sizes)  # type: ignore[union-attr]
    stop = min(node_int(node._saved_end), int(sizes[dim]))  # type: ignore[union-attr]
    return (
        dim == len(sizes) - 1
        and node_int(node._saved_start) == start  # type: ignore[union-attr]
        and stop == end
        and node_int(node._saved_step) == 1  # type: ignore[union-attr]
    )


def rotary_output(
    saved: torch.Tensor, base: torch.Tensor, recent: list[Origin], locate: Locate
) -> Derivation | None:
    """How to remake ``saved`` (a view of ``base``: ``q·cos + rotate_half(q)·sin``, ``q``
    a Linear's product after layout steps, itself after layout steps, an eager
    attention's head copies, or cast: under autocast a bf16 ``q`` times float32 tables
    runs in float32, and the attention takes a bf16 copy) from the Linear's input and
    the holders of ``cos`` and ``sin`` in ``recent``; None where ``base`` is not of
    that form or one of them is not there."""
    if not base.is_contiguous() and dense_order(base) is None:
        return None
    plan, to = _rotation(base, recent, locate), None
    if plan is None and type(base.grad_fn).__name__ == CAST_NODE:
        ((inner, slot),) = base.grad_fn.next_functions  # type: ignore[union-attr]
        for dtype in SOURCE_DTYPES:
            like = Unsaved(inner, base.shape, dtype, base.device, slot)
            plan = _rotation(like, recent, locate) if dtype != base.dtype else None  # type: ignore[arg-type]
            if plan is not None:
                to = base.dtype
                break
    if plan is None:
        return None
    place, rotated = placed(saved, base), plan.fn

    def fn(*values: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = rotated(*values)
            return place(out if to is None else out.to(to))

    return plan._replace(fn=fn)


def _rotation(t: torch.Tensor, recent: list[Origin], locate: Locate) -> Derivation | None:
    """:func:`rotary_output`'s plan for ``t`` itself (its values, in its shape)."""
    chain = layout_chain(t, _is_rotation)
    if chain is None:
        return None
    shape = torch.Size(chain.shape)  # the rotated tensor's
    edges = chain.start.next_functions  # type: ignore[attr-defined]
    for first, second in ((edges[0][0], edges[1][0]), (edges[1][0], edges[0][0])):
        plain, turned = _factor(first), _factor(second)
        if plain is not None and turned is not None and _halves(turned[0][0], plain[0], shape):
            break
    else:
        return None
    (q_edge, cos_attr), sin_attr = plain, turned[1]
    c, s = locate(first, cos_attr), locate(second, sin_attr)
    if c is None or s is None or not _table(recent[c], shape) or not _table(recent[s], shape):
        return None
    for dtype in dict.fromkeys((t.dtype, *SOURCE_DTYPES)):  # q's (autocast's: bf16)
        stand = Unsaved(q_edge[0], shape, dtype, t.device, q_edge[1])
        linear = linear_output(stand, stand, recent)  # type: ignore[arg-type]
        if linear is not None:
            break
    else:
        return None
    half, make_q = shape[-1] // 2, linear.fn

    def fn(x_hat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = make_q(x_hat)
        turned = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return chain.replay(q * cos + turned * sin)

    def gain(
        x: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[float, float, float]:
        turn = 1.0 if cos is None or sin is None else mean_square(cos) + mean_square(sin)
        through = float(linear.gain(x)) * turn  # type: ignore[arg-type]
        if x is None:
            return through, 1.0, 1.0
        # (q made apart from the product the unpacks share: a reading is no unpack)
        alone = linear_output(stand, stand, recent, shared=False)
        q_square = mean_square(alone.fn(x)) if alone is not None else 1.0
        return through, q_square, q_square

    sources = (linear.sources[0], c, s)
    return Derivation(
        fn, sources, "rotary of linear", gain, roots=(0, 1, 2),
        multiplies=linear.multiplies, claim=linear.claim,
    )  # fmt: skip


def _table(origin: Origin, shape: torch.Size) -> bool:
    """A rotation's table: no history, and broadcast to ``shape`` without enlarging it."""
    if origin.node is not None or origin.leaf is not None:
        return False
    try:
        return torch.broadcast_shapes(origin.shape, shape) == shape
    except RuntimeError:
        return False
