"""A dropout's output remade from its input and its mask (see
:mod:`lightning_acgc.engine.derive`), and the float mask packed at 1 bit a value.

On CPU ``F.dropout`` draws a float mask ``m`` (each value 0 or 1/(1 − p)) and returns
``x·m``: autograd saves ``m`` for backward, and the op after the dropout saves the output
as well (an attention's product with the values saves the dropped probabilities, whose
softmax saved them undropped already). On CUDA the fused dropout saves a bool mask and
``p`` instead. The engine packs a float tensor without autograd history that holds two
values with the lossless ``mask`` codec (:func:`without_history`), and stores such an
output ``y`` as nothing: at unpack it is ``x̂·m``, ``x̂`` what ``x``'s holder unpacks.
``m`` must come back exact (a holder that rounds it is not used), so ``y``'s error is
``m·(x̂ − x)``: ``x``'s rounding times ``mean(m²)`` (1/(1 − p)) in variance.

The same rule remakes any product ``x·c`` by a saved tensor ``c`` without history that
the engine holds exactly (a buffer, a tensor kept as it is). Which saved tensor is ``c``
is asked of autograd itself (``locate``: the holder it keeps for the node's saved
operand), not guessed from the order of saves.

Example:
    >>> from lightning_acgc.engine.derive import Origin
    >>> x = torch.randn(64, requires_grad=True)
    >>> s = torch.softmax(x, 0)
    >>> held = []
    >>> def pack(t):
    ...     held.append(t)
    ...     return len(held) - 1
    >>> with torch.autograd.graph.saved_tensors_hooks(pack, lambda i: held[i]):
    ...     y = torch.nn.functional.dropout(torch.softmax(x, 0), 0.5)
    >>> plan = dropout_output(y, y, [Origin.of(t) for t in held], lambda node, attr: 1)
    >>> plan.name, torch.equal(plan.fn(held[0], held[1]), y)
    ('dropout', True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_acgc.engine.derive_graph import Derivation, Origin, find, placed

__all__ = [
    "MUL_NODE",
    "NATIVE_DROPOUT_NODE",
    "dropout_output",
    "scaled",
    "scaled_node",
    "without_history",
]

MUL_NODE = "MulBackward0"
NATIVE_DROPOUT_NODE = "NativeDropoutBackward0"  # fused: saves a bool mask and p
Locate = Callable[[object, str], "int | None"]
Unsaved = Callable[[object, int, torch.Tensor, list[Origin]], "Derivation | None"]


def without_history(t: torch.Tensor) -> bool:
    """Whether ``t`` is a floating tensor without autograd history (no ``grad_fn``, no
    gradient wanted): what a dropout's float mask is. The engine offers such a tensor to
    the lossless ``mask`` codec first, which takes it where it holds at most two distinct
    values, none NaN, and declines it otherwise (one scan decides both).

    Example:
        >>> without_history(torch.tensor([0.0, 2.0])), without_history(torch.tensor([0, 1]))
        (True, False)
        >>> without_history(torch.ones(2, requires_grad=True) * 2)
        False
    """
    return t.grad_fn is None and not t.requires_grad and t.is_floating_point()


def scaled(base: torch.Tensor) -> bool:
    """A cheap test: ``base`` is a dropout's output, or a product ``x·c`` of which one
    factor has no autograd history."""
    return scaled_node(base.grad_fn)


def scaled_node(node: object) -> bool:
    """:func:`scaled` of the tensor autograd node ``node`` made."""
    kind = type(node).__name__
    if kind == NATIVE_DROPOUT_NODE:
        return True
    if kind != MUL_NODE:
        return False
    edges = node.next_functions  # type: ignore[union-attr]
    return len(edges) == 2 and (edges[0][0] is None) != (edges[1][0] is None)


def dropout_output(
    saved: torch.Tensor,
    base: torch.Tensor,
    recent: list[Origin],
    locate: Locate,
    unsaved: Unsaved | None = None,
) -> Derivation | None:
    """How to remake ``saved`` (a view of ``base``, a dropout's output or a product by a
    tensor without history) from its input and its mask in ``recent``; None where the
    input is not there or the mask is not held exactly (``locate`` gives None).

    Where no op saved the input ``x`` (a LayerNorm's or an activation's output that only
    the dropout reads: BERT's embeddings, a feed-forward's ``dropout(gelu(h))``),
    ``unsaved(node, slot, base, recent)`` may remake ``x`` from what its own op saved:
    ``y`` is then made from those, with ``x``'s gain times the mask's."""
    node = base.grad_fn
    edges = node.next_functions  # type: ignore[union-attr]
    if type(node).__name__ == NATIVE_DROPOUT_NODE:
        k, attr = 0, "_saved_result1"
        scale = 1.0 / (1.0 - float(node._saved_p))  # type: ignore[union-attr]
    else:
        k = 0 if edges[0][0] is not None else 1
        attr, scale = ("_saved_other" if k == 0 else "_saved_self"), None
    i = find(recent, edges[k], base)
    inner = None
    if i is None and unsaved is not None and edges[k][0] is not None:
        inner = unsaved(edges[k][0], edges[k][1], base, recent)  # x itself was not saved
        if inner is None or inner.kept is not None or inner.roots != (0,) or inner.multiplies:
            return None
    elif i is None:
        return None
    j = locate(node, attr)
    firsts = (i,) if inner is None else inner.sources
    if j is None or j in firsts or recent[j].node is not None or recent[j].leaf is not None:
        return None
    place = placed(saved, base)

    def fn(*values: torch.Tensor) -> torch.Tensor:
        *xs, mask = values
        x_hat = xs[0] if inner is None else inner.fn(*xs)
        with torch.no_grad():
            return place(x_hat * mask if scale is None else x_hat * mask * scale)

    def gain(*values: torch.Tensor | None) -> float:
        *xs, mask = values
        g = 1.0 if inner is None else float(inner.gain(*xs))  # type: ignore[arg-type]
        if mask is None:
            return g if scale is None else g * scale  # a dropout's mean m² is 1/(1 − p)
        with torch.no_grad():
            m = mask.double()
            return g * float(m.square().mean() * (1.0 if scale is None else scale * scale))

    name = "dropout" if inner is None else f"dropout of {inner.name}"
    return Derivation(fn, (*firsts, j), name, gain, stored=(len(firsts),))
