"""Autocast's copies of activations, remade: a saved 16-bit cast of a float32 tensor that
no op saved (a LayerNorm's, an activation's or a dropout's output), cast again at unpack
from what remakes that tensor.

Under autocast (``precision="bf16-mixed"``) LayerNorm and softmax run in float32 and the
Linear after them in bf16: each Linear casts its input first, and saves the cast. A
transformer block's query, key and value projections each save their own bf16 copy of
the same LayerNorm output, the feed-forward's first Linear a copy of the next one, the
attention's second product a copy of its dropped-out probabilities. In float32 these are
the LayerNorm's (or the dropout's) output itself, which acgc stores as nothing and remakes
(:mod:`lightning_acgc.engine.derive`); under autocast they were compressed one by one: on
the quick BERT recipe half of the bytes acgc kept.

A cast node keeps no attribute that gives its input's dtype, and its input was never
saved: the input is described by a stand-in (:class:`Unsaved`, the cast's shape and
device in each floating dtype other than its own), and a derivation is found only where
the op that made it has its own input, of that dtype, among the saved tensors, so a plan
never guesses the dtype. The result is cast again as autocast cast it (the same rounding).

Example:
    >>> from lightning_acgc.engine.derive import unsaved_input
    >>> from lightning_acgc.engine.derive_graph import Origin
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> y = torch.nn.functional.gelu(x).to(torch.bfloat16)
    >>> def activation(like, recent):  # what remakes a GELU's output no op saved
    ...     return unsaved_input(like.grad_fn, like.output_nr, like, recent)
    >>> plan = cast_output(y, y, [Origin.of(x)], activation)
    >>> plan.name, torch.equal(plan.fn(x.detach()), y.detach())
    ('bfloat16 cast of gelu', True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_acgc.engine.derive_graph import Derivation, Origin, placed

__all__ = ["CAST_NODE", "Unsaved", "cast_output", "casts_activation"]

CAST_NODE = "ToCopyBackward0"
# the dtypes a cast's input may have (autocast casts float32 down; tried in this order)
SOURCE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# remakes the unsaved input of a cast, described by its stand-in: (stand-in, recent) -> plan
Inner = Callable[["Unsaved", list[Origin]], Derivation | None]


@dataclass(frozen=True)
class Unsaved:
    """Stands for a contiguous tensor no op saved (a cast's input): what the derivations
    read of a tensor they remake (its node, shape, dtype and device), none of its values."""

    grad_fn: object
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    output_nr: int = 0
    _base: None = None

    def is_contiguous(self) -> bool:
        return True

    def dim(self) -> int:
        return len(self.shape)

    def stride(self) -> tuple[int, ...]:
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= max(size, 1)
        return tuple(reversed(strides))

    def storage_offset(self) -> int:
        return 0


def casts_activation(base: torch.Tensor, inner_kinds: frozenset[str]) -> bool:
    """A cheap test: ``base`` is a floating cast of the output of a node of ``inner_kinds``."""
    node = base.grad_fn
    if type(node).__name__ != CAST_NODE or not base.is_floating_point():
        return False
    edges = node.next_functions  # type: ignore[union-attr]
    return len(edges) == 1 and type(edges[0][0]).__name__ in inner_kinds


def cast_output(
    saved: torch.Tensor, base: torch.Tensor, recent: list[Origin], inner: Inner
) -> Derivation | None:
    """How to remake ``saved`` (a view of ``base``, a dtype cast of a tensor no op saved)
    from what remakes the cast's input (``inner(stand-in, recent)``: an activation's or a
    LayerNorm's output, :func:`~lightning_acgc.engine.derive.unsaved_input`, or a
    dropout's), cast again to ``base``'s dtype; None where there is no such plan for any
    source dtype."""
    node, slot = base.grad_fn.next_functions[0]  # type: ignore[union-attr]
    if node is None or not base.is_contiguous():
        return None
    for dtype in SOURCE_DTYPES:
        if dtype == base.dtype:
            continue
        plan = inner(Unsaved(node, base.shape, dtype, base.device, slot), recent)
        if plan is not None:
            break
    else:
        return None
    place, to, inner_fn = placed(saved, base), base.dtype, plan.fn

    def fn(*values: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return place(inner_fn(*values).to(to))

    return plan._replace(fn=fn, name=f"{str(to).removeprefix('torch.')} cast of {plan.name}")
