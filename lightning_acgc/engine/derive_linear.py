"""Linear outputs remade from the Linear's saved input: an attention's query, key and
value, a feed-forward's pre-activation.

A Linear saves its input ``x`` for its weight's gradient. Its output ``y = x·Wᵀ + b`` is
saved too where the next op needs it: the attention's ``q·kᵀ`` and ``p·v`` products save
q, k and v (after a head split: a view, a transpose, a copy), a GELU saves its input (a
view of the feed-forward's first product). Where the policy derives outputs, such a
``y`` is stored as nothing: at unpack the product is made again from what ``x``'s holder
unpacks and the same view, transpose and copy steps are replayed. On BERT-base q, k and
v were a quarter of acgc's kept bytes. The price is the product itself, once more in
backward, as checkpointing pays it.

``y``'s error is then ``(x̂ − x)·Wᵀ``: for rounding errors independent across ``x``'s
features, ``‖W‖²_F / out_features`` times ``x``'s variance per value
(:func:`linear_gain`), the factor the error model charges ``y``'s sensitivity with.

Example:
    >>> from lightning_acgc.engine.derive_graph import Origin
    >>> lin = torch.nn.Linear(8, 4)
    >>> x = torch.randn(6, 8, requires_grad=True) * 1.0
    >>> q = lin(x).view(2, 3, 2, 2).transpose(1, 2).reshape(4, 3, 2)
    >>> plan = linear_output(q, q, [Origin.of(x)])
    >>> plan.name, torch.allclose(plan.fn(x.detach()), q.detach())
    ('linear', True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_acgc.engine.derive_graph import (
    Derivation,
    Origin,
    check_unchanged,
    placed,
    used_param,
)
from lightning_acgc.engine.layout_chain import LAYOUT_NODES, layout_chain

__all__ = ["LAYOUT_NODES", "LINEAR_NODES", "linear_gain", "linear_output", "made_by_linear"]

# autograd nodes of a Linear's product: with a bias (addmm), without one (mm)
LINEAR_NODES = frozenset({"AddmmBackward0", "MmBackward0"})


def _is_product(node: object) -> bool:
    return type(node).__name__ in LINEAR_NODES


def made_by_linear(base: torch.Tensor) -> bool:
    """Whether ``base`` is a Linear's product, or layout ops of one (a cheap test of the
    graph only)."""
    return layout_chain(base, _is_product) is not None


def _weight(edge: tuple[object, int]) -> tuple[torch.Tensor, bool] | None:
    """The parameter behind the product's second factor and whether it is used
    transposed: ``Wᵀ`` of an (out, in) weight (nn.Linear), or an (in, out) weight as it is
    (Hugging Face's ``Conv1D``, GPT-2's dense layer); None otherwise."""
    node = edge[0]
    transposed = node is not None and type(node).__name__ == "TBackward0"
    param = used_param(node.next_functions[0] if transposed else edge)  # type: ignore[union-attr]
    if not isinstance(param, torch.Tensor) or param.dim() != 2:
        return None
    return param, transposed


def linear_gain(weight: torch.Tensor, alpha: float = 1.0) -> float:
    """``alpha²·‖W‖²_F / out_features``: the mean factor from the variance of errors
    independent across a Linear's input features to its output's.

    Example:
        >>> linear_gain(torch.full((4, 9), 2.0))
        36.0
    """
    with torch.no_grad():
        w = weight.detach().double()
        return float(alpha * alpha * w.square().sum() / max(1, w.shape[0]))


def linear_output(
    saved: torch.Tensor, base: torch.Tensor, recent: list[Origin], shared: bool = True
) -> Derivation | None:
    """How to remake ``saved`` (a view of ``base``, a Linear's product after layout
    ops) from the Linear's input among ``recent``; None where it is not one, the input
    is not there, the weight is not a parameter (used as it is or cast by autocast) or
    the bias is computed. ``shared``: the product made once for every tensor remade
    from it (:class:`_Shared`; else each call makes its own: a gain's reading)."""
    chain = layout_chain(base, _is_product)
    if chain is None:
        return None
    node, shape = chain.start, chain.shape
    edges = node.next_functions  # type: ignore[attr-defined]
    with_bias = type(node).__name__ == "AddmmBackward0"
    if with_bias and edges[0][0] is None:  # a bias that takes no gradient: not read here
        return None
    bias = used_param(edges[0]) if with_bias else None
    input_edge, weight_edge = edges[1:] if with_bias else edges
    used = _weight(weight_edge)
    if used is None or bias is False or len(shape) != 2:
        return None
    weight, transposed = used
    factor = weight.t() if transposed else weight  # (in, out): the product's x·factor
    rows = shape[0]
    found = [
        i
        for i in range(len(recent) - 1, -1, -1)
        if recent[i].made(input_edge)
        and recent[i].dtype == base.dtype
        and tuple(recent[i].shape) == (rows, factor.shape[0])
    ]
    if not found or tuple(shape) != (rows, factor.shape[1]):
        return None
    alpha = float(getattr(node, "_saved_alpha", 1)) if with_bias else 1.0
    beta = float(getattr(node, "_saved_beta", 1)) if with_bias else 1.0
    view = placed(saved, base)
    dtype = base.dtype  # (not ``base`` in the closures: it would hold the output alive)

    unchanged = check_unchanged("a Linear's weight or bias", weight, bias)
    memo = _Shared.of(node) if shared else None

    def product(x_hat: torch.Tensor) -> torch.Tensor:
        unchanged()
        with torch.no_grad():  # (the casts: autocast's, see used_param; else no-ops)
            w = factor.to(dtype)
            if bias is None:
                y = torch.mm(x_hat, w)
                return y * alpha if alpha != 1.0 else y
            return torch.addmm(bias.to(dtype), x_hat, w, beta=beta, alpha=alpha)

    def fn(x_hat: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = product(x_hat) if memo is None else memo.product(x_hat, product)
            return view(chain.replay(y))

    def gain(x: torch.Tensor | None) -> float:
        return linear_gain(factor.t(), alpha)

    claim = None if memo is None else memo.claim
    return Derivation(fn, (found[0],), "linear", gain, multiplies=int(factor.shape[0]), claim=claim)


class _Shared:
    """One product made again for every tensor remade from it: a fused projection's
    q, k and v (GPT-2's ``c_attn``, split in three) each remade the whole product, three
    times the multiplies for one. Kept on the product's node (``metadata``, freed with
    the graph) from the first unpack of the tensors remade from it to the last (one for
    each plan the engine took: :meth:`claim`), with the input it was made of; reused
    where the input's holder gives back the same values (the same decoded tensor, or one
    decoded again: the same bytes decode alike; a NaN never compares equal, so an input
    with one makes its product each time)."""

    KEY = "lightning_acgc.remade_product"

    def __init__(self) -> None:
        self.users = 0
        self.pending = 0
        self.x_hat: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    @classmethod
    def of(cls, node: object) -> _Shared:
        """The node's record (made at the first plan of the step's graph)."""
        return node.metadata.setdefault(cls.KEY, cls())  # type: ignore[attr-defined]

    def claim(self) -> None:
        """One more tensor remade from the product (its plan taken by the engine)."""
        self.users += 1
        self.pending += 1

    def product(
        self, x_hat: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``make(x_hat)``, or the product already made of this very tensor."""
        same = self.x_hat is not None and (
            self.x_hat is x_hat or torch.equal(self.x_hat, x_hat)  # (decoded again alike)
        )
        y = self.y if same else None
        if y is None:
            y = make(x_hat)
            self.x_hat, self.y = x_hat, y
        self.pending -= 1
        if self.pending <= 0:  # the last user (or a second unpack): let go
            self.x_hat = self.y = None
            self.pending = self.users
        return y
