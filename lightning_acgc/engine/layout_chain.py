"""Layout ops read off the autograd graph and replayed: the view, transpose, permute,
expand, copy, split and select steps between an op's result and the tensor a later op
saved (an attention's q after the head split: ``view``, ``transpose``, ``expand``, a
contiguous copy, ``reshape``; a fused q-k-v projection's ``unbind`` or ``split``; a
Hugging Face KV cache's first update, ``cat([empty cache, k])``, as k itself where the
saved tensor's size shows the cache empty).

Walking back from the saved tensor, each node gives the forward step that replays it and
its input's shape from its output's (a size an ``unbind`` drops is unknown, -1, until a
node that saved its input's sizes further back fixes it).

Example:
    >>> x = torch.randn(6, 12, requires_grad=True)
    >>> y = x * 1.0
    >>> q, k, v = y.view(2, 3, 3, 4).permute(2, 0, 1, 3)
    >>> chain = layout_chain(k, lambda node: node is y.grad_fn)
    >>> chain.start is y.grad_fn, chain.shape, torch.equal(chain.replay(y.detach()), k.detach())
    (True, (6, 12), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["LAYOUT_NODES", "Chain", "layout_chain", "node_int"]

Step = Callable[[torch.Tensor], torch.Tensor]
Shape = tuple[int, ...]

RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
# nodes with several outputs: which one the chain came through says what the step takes
MULTI_OUTPUT = frozenset({"UnbindBackward0", "SplitBackward0", "SplitWithSizesBackward0"})
# a concatenation whose other parts take no gradient: replayed as its one part, where
# they are empty (a Hugging Face KV cache's first update: ``cat([empty, k])``; see
# _consistent for how the walk tells)
CAT = "CatBackward0"
LAYOUT_NODES = (
    RESHAPES
    | MULTI_OUTPUT
    | {
        CAT,
        "ExpandBackward0",
        "CloneBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward1",
    }
)
MAX_STEPS = 16


class Chain(NamedTuple):
    """The node the layout ops start from (its output slot 0), the forward steps in
    forward order, and that node's output shape."""

    start: object
    steps: tuple[Step, ...]
    shape: Shape

    def replay(self, y: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            y = step(y)
        return y


def node_int(value: object) -> int:
    """An integer read off a node (negative ones come back as unsigned 64-bit)."""
    v = int(value)  # type: ignore[call-overload]
    return v - 2**64 if v >= 2**63 else v


def _dim(value: object, ndim: int) -> int:
    return node_int(value) % ndim if ndim else 0


def _sizes(node: object) -> Shape:
    return tuple(int(s) for s in node._saved_self_sym_sizes)  # type: ignore[attr-defined]


def _sized_step(node: object, kind: str, shape: Shape) -> tuple[Step, Shape] | None:
    """Steps of nodes that saved their input's sizes."""
    before = _sizes(node)
    if kind in RESHAPES:
        if shape.count(-1) > 1:
            return None
        return (lambda y: y.reshape(shape)), before
    if kind == "ExpandBackward0":
        return ((lambda y: y.expand(shape)), before) if -1 not in shape else None
    dim = _dim(node._saved_dim, len(before))  # type: ignore[attr-defined]
    if kind == "SelectBackward0":
        index = node_int(node._saved_index)  # type: ignore[attr-defined]
        return (lambda y: y.select(dim, index)), before
    if kind == "SliceBackward0":
        start, end = node_int(node._saved_start), node_int(node._saved_end)  # type: ignore[attr-defined]
        step = node_int(node._saved_step)  # type: ignore[attr-defined]
        return (lambda y: torch.ops.aten.slice(y, dim, start, end, step)), before
    if kind == "SqueezeBackward1":
        return (lambda y: y.squeeze(dim)), before
    return None


def _split_step(node: object, kind: str, shape: Shape, slot: int) -> tuple[Step, Shape] | None:
    """Steps of nodes with several outputs, for output ``slot``."""
    if kind == "UnbindBackward0":
        dim = _dim(node._saved_dim, len(shape) + 1)  # type: ignore[attr-defined]
        return (lambda y: y.select(dim, slot)), (*shape[:dim], -1, *shape[dim:])
    before = _sizes(node)
    dim = _dim(node._saved_dim, len(before))  # type: ignore[attr-defined]
    if kind == "SplitBackward0":
        size = int(node._saved_split_size)  # type: ignore[attr-defined]
        start, length = slot * size, min(size, before[dim] - slot * size)
    else:
        sizes = [int(s) for s in node._saved_split_sizes]  # type: ignore[attr-defined]
        start, length = sum(sizes[:slot]), sizes[slot]
    return (lambda y: y.narrow(dim, start, length)), before


def _step(node: object, shape: Shape, slot: int) -> tuple[Step, Shape] | None:
    """The forward step of layout node ``node`` whose output ``slot`` has ``shape``,
    and its input's shape; None where it cannot be replayed."""
    kind = type(node).__name__
    if kind in MULTI_OUTPUT:
        return _split_step(node, kind, shape, slot)
    if slot != 0:
        return None
    if kind in ("CloneBackward0", CAT):
        return (lambda y: y.contiguous()), shape
    if kind == "TBackward0":
        return (lambda y: y.t()), shape[::-1]
    if kind == "TransposeBackward0":
        d0 = _dim(node._saved_dim0, len(shape))  # type: ignore[attr-defined]
        d1 = _dim(node._saved_dim1, len(shape))  # type: ignore[attr-defined]
        before = list(shape)
        before[d0], before[d1] = shape[d1], shape[d0]
        return (lambda y: y.transpose(d0, d1)), tuple(before)
    if kind == "PermuteBackward0":
        dims = [_dim(d, len(shape)) for d in node._saved_dims]  # type: ignore[attr-defined]
        permuted = [0] * len(shape)
        for i, d in enumerate(dims):
            permuted[d] = shape[i]
        return (lambda y: y.permute(dims)), tuple(permuted)
    if kind == "UnsqueezeBackward0":
        dim = _dim(node._saved_dim, len(shape))  # type: ignore[attr-defined]
        return (lambda y: y.unsqueeze(dim)), (*shape[:dim], *shape[dim + 1 :])
    return _sized_step(node, kind, shape)


def layout_chain(t: torch.Tensor, is_start: Callable[[object], bool]) -> Chain | None:
    """Walk from ``t``'s node back over layout ops to the first node ``is_start``
    accepts: the chain that replays ``t`` from that node's output. None where another
    op comes first, a step cannot be replayed, the start's shape is not known, or the
    chain is longer than MAX_STEPS."""
    node, slot, shape = t.grad_fn, t.output_nr, tuple(t.shape)
    steps: list[Step] = []
    outputs: list[Shape] = []  # each step's output shape, as the walk reads it
    concatenated = False
    for _ in range(MAX_STEPS):
        if node is None:
            return None
        if is_start(node):
            if slot != 0 or -1 in shape:
                return None
            chain = Chain(node, tuple(steps[::-1]), shape)
            return chain if not concatenated or _consistent(chain, outputs[::-1]) else None
        kind = type(node).__name__
        if kind not in LAYOUT_NODES or (concatenated and _broadcasts(node, kind, shape)):
            return None
        concatenated = concatenated or kind == CAT
        outputs.append(shape)
        got = _step(node, shape, slot)
        edges = [e for e in node.next_functions if e[0] is not None]  # type: ignore[attr-defined]
        if got is None or len(edges) != 1:
            return None
        step, shape = got
        steps.append(step)
        node, slot = edges[0]
    return None


def _broadcasts(node: object, kind: str, shape: Shape) -> bool:
    """An expand to sizes it has not got (before a concatenation, it could make rows the
    size of the cached ones from one)."""
    return kind == "ExpandBackward0" and _sizes(node) != shape


def _consistent(chain: Chain, outputs: list[Shape]) -> bool:
    """Whether the chain, replayed from its start's shape on a meta tensor, gives at each
    step the output shape the walk read there (the saved tensor's last). A concatenation
    is read as its one part: had it other parts with values, the sizes after it (the
    saved tensor's, the input sizes a view, select or expand recorded) are theirs too and
    the replay's differ, or the start's shape carries them and differs from the
    product's, which the caller reads off the product's input (``linear_output``)."""
    y = torch.empty(chain.shape, device="meta")
    try:
        for step, shape in zip(chain.steps, outputs, strict=True):
            y = step(y)
            if tuple(y.shape) != shape:
                return False
    except RuntimeError:
        return False
    return True
