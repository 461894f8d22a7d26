"""A gated unit's product ``a·b``, saved by the next Linear, remade from its two factors'
holders (see :mod:`lightning_acgc.engine.derive`).

Llama's, Mistral's and Qwen's MLP is ``down(silu(gate(x)) · up(x))`` (SwiGLU; GeGLU,
ReGLU alike): the product saves both factors for its backward, and ``down`` saves the
product, the widest tensor of the block (intermediate size, and a third of a Llama
layer's packed bytes with the factors remade). With ``acgc`` it is stored as nothing:
at unpack it is ``â·b̂``, from what the factors' holders unpack (themselves often remade:
the SiLU of the gate's product, the up projection). Its error ``b·(â − a) + a·(b̂ − b)``
reaches it from both holders (``Derivation.roots``): ``a``'s rounding times ``mean(b²)``
in variance and ``b``'s times ``mean(a²)``.

Example:
    >>> from lightning_acgc.engine.derive_graph import Origin
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> a, b = torch.nn.functional.silu(x * 2), x * 3
    >>> y = a * b
    >>> plan = gated_output(y, y, [Origin.of(a), Origin.of(b)])
    >>> plan.name, plan.roots, torch.equal(plan.fn(a.detach(), b.detach()), y.detach())
    ('product', (0, 1), True)
"""

from __future__ import annotations

import torch

from lightning_acgc.engine.derive_dropout import MUL_NODE
from lightning_acgc.engine.derive_graph import Derivation, Origin, find, mean_square, placed

__all__ = ["gated", "gated_output"]


def gated(base: torch.Tensor) -> bool:
    """A cheap test: ``base`` is a product of two tensors that both have history."""
    node = base.grad_fn
    if type(node).__name__ != MUL_NODE:
        return False
    edges = node.next_functions  # type: ignore[union-attr]
    return len(edges) == 2 and edges[0][0] is not None and edges[1][0] is not None


def gated_output(
    saved: torch.Tensor, base: torch.Tensor, recent: list[Origin]
) -> Derivation | None:
    """How to remake ``saved`` (a view of ``base = a·b``, both factors of its shape and
    dtype) from the factors' holders in ``recent``; None where either is not there."""
    if not gated(base):
        return None
    first, second = base.grad_fn.next_functions  # type: ignore[union-attr]
    i, j = find(recent, first, base), find(recent, second, base)
    if i is None or j is None or recent[i].leaf is not None or recent[j].leaf is not None:
        return None  # (a parameter factor: read again at unpack unchecked, so not taken)
    place = placed(saved, base)
    if i == j:  # a·a: one holder, the error doubled

        def square(a: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return place(a * a)

        return Derivation(square, (i,), "product", lambda a: 4 * mean_square(a))

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return place(a * b)

    def gain(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[float, float]:
        return mean_square(b), mean_square(a)

    return Derivation(fn, (i, j), "product", gain, roots=(0, 1))
