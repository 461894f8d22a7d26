"""Which checkpointed regions are smooth in their input: what acgc reads off the
autograd graph to choose how far a region's saved input may be rounded.

Backward runs a checkpointed region again from its decoded input. Where the region
holds an op whose derivative jumps (a ReLU, a max-pool, a clamp), every element within
the rounding of the jump flips its mask and sends a whole δ element the wrong way; the
error grows like the square root of the rounding (on the quick ResNet, block inputs at 8
bits alone: 0.11-0.19 against e = 0.05). Where every op of the region is smooth (a
transformer block: matmuls, softmax, GELU, LayerNorm, dropout with its mask replayed),
the rounding reaches the gradient like any other saved tensor's: BERT-base with its
block inputs at 8 bits measured 0.023 (81x) against 0.021 as float16 (45x).

:class:`RegionKinds` finds out on calibration steps, from the graph that the forward
built (non-reentrant checkpointing builds the region's graph as usual; it only keeps
the tensors the region saves out of it). When the input of region ``i + 1`` is saved,
the walk from its autograd node back to region ``i``'s input passes through region
``i``'s ops: a node from :data:`KINKED` among them marks the region kinked, and so does
a custom ``autograd.Function``, whose ops the graph does not show (reentrant
checkpointing's region, a fused kernel, a compiled graph). A walk that does not reach
the earlier input (from the first block's input, or between regions apart from each
other) says nothing. A class of inputs (the same input of
every block) is smooth when a walk read one of its regions and none was kinked.
"""

from __future__ import annotations

import torch
from torch.autograd.function import BackwardCFunction

from lightning_acgc.engine.derive_graph import Origin

__all__ = ["KINKED", "RegionKinds", "kinked_between"]

# Autograd nodes of ops whose derivative jumps (prefixes of their class names).
KINKED = (
    "Relu", "Threshold", "Hardtanh", "LeakyRelu", "Prelu", "Rrelu", "Elu", "Selu",
    "MaxPool", "AdaptiveMaxPool", "FractionalMaxPool", "Max", "Min", "Amax", "Amin",
    "Hardswish", "Hardsigmoid", "Hardshrink", "Softshrink", "Abs", "Clamp", "Sign",
    "Sort", "Topk", "Kthvalue", "Median", "Mode", "Floor", "Ceil", "Round", "Trunc",
    "Frac", "Remainder", "Fmod", "Where", "MaskedFill", "MaskedScatter", "IndexPut",
)  # fmt: skip
WALK_LIMIT = 20_000  # nodes visited before a walk gives up (says nothing)


def _kinked(node: object) -> bool:
    """A kinked op, or one whose ops the graph does not show: a custom
    ``autograd.Function`` (reentrant checkpointing's region, a fused kernel, a compiled
    graph) counts as kinked."""
    return isinstance(node, BackwardCFunction) or type(node).__name__.startswith(KINKED)


def kinked_between(end: torch.Tensor, start: Origin, limit: int = WALK_LIMIT) -> bool | None:
    """Whether the graph from ``start`` to ``end`` holds a kinked op: ``True``, ``False``,
    or ``None`` where the walk back from ``end`` never reached ``start``.

    Example:
        >>> x = torch.randn(4, requires_grad=True) * 1.0
        >>> start = Origin.of(x)
        >>> kinked_between(torch.tanh(x) @ torch.ones(4), start)
        False
        >>> kinked_between(torch.relu(x).sum(), start)
        True
        >>> kinked_between(torch.randn(2, requires_grad=True).sum(), start) is None
        True
    """
    if end.grad_fn is None:
        return None
    stack, seen, reached, kinked = [end.grad_fn], set(), False, False
    while stack and len(seen) < limit:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        kinked = kinked or _kinked(node)
        for edge in getattr(node, "next_functions", ()):
            if start.made(edge):
                reached = True
            elif edge[0] is not None:
                stack.append(edge[0])
    if not reached:
        return None
    if stack:  # gave up before the whole walk: only a kink already found tells
        return True if kinked else None
    return kinked


class RegionKinds:
    """Per class of checkpointed inputs: whether its regions are smooth (see above)."""

    def __init__(self) -> None:
        self.kinked: dict[str, bool] = {}  # class -> whether a region of it is kinked
        self._last: tuple[str, Origin] | None = None  # the input noted last, this pass

    def note(self, cls: str, x: torch.Tensor) -> None:
        """A checkpointed region's input of class ``cls`` is saved: read the region that
        the input noted before it went through, if the walk reaches it. An input outside
        the graph (an attention mask) reads nothing and is not read."""
        if x.grad_fn is None and not x.requires_grad:
            return
        if self._last is not None:
            before, origin = self._last
            found = kinked_between(x, origin)
            if found is not None:
                self.kinked[before] = self.kinked.get(before, False) or found
        self._last = (cls, Origin.of(x))

    def forget(self) -> None:
        """A new step: its first input reads nothing. The last step's autograd node is let
        go (a graph never run backward is not kept alive by it), and no walk searches a
        whole new graph for a node of the old one."""
        self._last = None

    def smooth(self, cls: str) -> bool:
        """Whether a region of class ``cls`` was read and none of them was kinked."""
        return self.kinked.get(cls) is False
