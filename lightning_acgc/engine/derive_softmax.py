"""An eager attention's probabilities, remade: ``softmax(q·kᵀ ∘ steps)`` run again at
unpack from what the holders of the scores' batched matmul operands unpack (see
:mod:`lightning_acgc.engine.derive`).

An attention written out (the char-LM recipe's, Hugging Face's ``eager``) saves its
probabilities ``p = softmax(s)`` for the softmax's backward and for ``p·v``: on the
char-LM sweep's model they were a third of acgc's kept bytes, and rounding them is what
the per-layer promise broke on first (a softmax's backward ``dS = p·(dP − rowsum(dP·p))``
cancels the signal, not the rounding: see :mod:`lightning_acgc.policies.acgc_floors`'s
softmax alarm, which then kept them as float16 for the rest of a fit). The scores' batched
matmul saves its two operands (the query and the transposed key, which acgc stores or
remakes anyway), so ``p`` made again from them costs no bytes, and its error is that of a
softmax at perturbed scores: its rows still sum to one and its backward is the exact
derivative at that point.

The steps between the product and the softmax that are read off the graph: one view to
the probabilities' shape, a multiplication or division by a one-element constant (the
scale), a cast to the probabilities' dtype right before the softmax (bf16 scores under
autocast, softmax taken in float32), ``masked_fill`` with a mask whose holder gives it
back exactly (filled with ``-inf``), and the addition of a tensor that needs no gradient
(an additive mask), which the graph does not keep: where ``p`` is exactly 0 is kept
instead, 1 bit a value, and filled with ``-inf``, and the rows it covered whole (uniform:
a decoder's left padding), 1 bit a row, filled with 0 (nothing where there is neither).
What a step did to the values is not all on the graph (a fill value, an added bias that
is not a mask), so a site's probabilities are remade only after a
check: on a measuring step, where the saved operands are at hand, the remaking from them
must give the saved ``p`` back (:class:`SoftmaxChecks`; checked again on each measuring
step).

Example:
    >>> q, kt = torch.randn(6, 8, 4), torch.randn(6, 4, 8)
    >>> q.requires_grad_(); kt.requires_grad_()  # doctest: +ELLIPSIS
    tensor(...)
    tensor(...)
    >>> causal = torch.ones(8, 8, dtype=torch.bool).tril()
    >>> s = torch.bmm(q, kt).view(3, 2, 8, 8) * 0.5
    >>> p = s.masked_fill(~causal, float("-inf")).softmax(-1)
    >>> held = {"_saved_self": 0, "_saved_mat2": 1, "_saved_mask": 2}  # positions
    >>> plan = softmax_output(p, p, lambda node, attr, exact: (attr in held, held.get(attr)))
    >>> plan.name, plan.sources, plan.roots
    ('softmax', (0, 1, 2), (0, 1))
    >>> torch.equal(plan.fn(q.detach(), kt.detach(), ~causal), p.detach())
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_acgc.engine.derive_attention import Find
from lightning_acgc.engine.derive_graph import Derivation, perturbation_gains, placed
from lightning_acgc.engine.layout_chain import node_int
from lightning_acgc.kernels.mask import mask_pack, mask_unpack

__all__ = ["SOFTMAX_NODE", "SoftmaxChecks", "softmax_of_product", "softmax_output"]

SOFTMAX_NODE = "SoftmaxBackward0"
BMM_NODE = "BmmBackward0"
VIEW_NODES = frozenset({"UnsafeViewBackward0", "ViewBackward0"})
SCALE_NODES = {"MulBackward0": torch.mul, "DivBackward0": torch.div}
MASKED_FILL_NODE = "MaskedFillBackward0"
ADD_NODE = "AddBackward0"
CAST_NODE = "ToCopyBackward0"
MAX_STEPS = 6  # steps read between the softmax and the product, at most
# the deepest remaking the operands may be (Derivation.max_depth): a query of a Linear's
# output of a LayerNorm's output remade (the char-LM's)
MAX_DEPTH = 3
# the remaking from the exact operands against the saved probabilities (a check)
CHECK_RTOL, CHECK_ATOL = 1e-5, 1e-7


def _steps(base: torch.Tensor) -> tuple[list[tuple[str, Any]], Any] | None:
    """The steps from the batched matmul to ``base``'s softmax, in forward order, and the
    matmul's node; None where ``base`` is not such a softmax's output."""
    node = base.grad_fn
    if type(node).__name__ != SOFTMAX_NODE:
        return None
    steps: list[tuple[str, Any]] = []
    inner = node.next_functions[0][0]
    while inner is not None and len(steps) <= MAX_STEPS:
        kind = type(inner).__name__
        if kind == BMM_NODE:
            views = sum(k == "view" for k, _ in steps)
            return (steps[::-1], inner) if views <= 1 else None
        edges = inner.next_functions
        if kind in VIEW_NODES:
            steps.append(("view", inner))
        elif kind == CAST_NODE and not steps:  # (the softmax's input cast to its dtype)
            steps.append(("cast", inner))
        elif kind == MASKED_FILL_NODE and len(edges) == 1:
            steps.append(("masked_fill", inner))
        elif kind in SCALE_NODES or kind == ADD_NODE:
            if len(edges) != 2 or edges[1][0] is not None:  # (a learned scale, a bias)
                return None
            steps.append((kind, inner))
        else:
            return None
        inner = edges[0][0]
    return None


def softmax_of_product(base: torch.Tensor) -> bool:
    """A cheap test: ``base`` is a softmax's output over a batched matmul's scores (the
    steps between them of the kinds this module remakes)."""
    return type(base.grad_fn).__name__ == SOFTMAX_NODE and _steps(base) is not None


def softmax_output(saved: torch.Tensor, base: torch.Tensor, find: Find) -> Derivation | None:
    """How to remake ``saved`` (a view of ``base``, a softmax's output over a batched
    matmul's scores) from the holders of the matmul's operands and of any mask
    ``masked_fill`` saved (exact) that ``find`` gives; None where one is not there, a
    constant is not at hand, or ``base`` is not contiguous. Where an added tensor
    masked the scores, the plan keeps where ``base`` is 0 (``Derivation.kept``)."""
    found = _steps(base)
    if found is None or not base.is_contiguous() or not base.numel():
        return None
    steps, bmm = found
    operands = [find(bmm, attr, False)[1] for attr in ("_saved_self", "_saved_mat2")]
    if any(i is None for i in operands):
        return None
    ops: list[Callable[..., torch.Tensor]] = []
    sources: list[int] = [*operands]  # type: ignore[list-item]
    dim = node_int(base.grad_fn._saved_dim)  # type: ignore[union-attr]
    shape, dtype = base.shape, base.dtype  # (the closures hold these, never ``base``)
    added: tuple[torch.Tensor | None, Callable[..., torch.Tensor] | None] | None = None
    for kind, node in steps:
        if kind == "view":
            ops.append(lambda s, *_: s.reshape(shape))
        elif kind == "cast":
            ops.append(lambda s, *_: s.to(dtype))
        elif kind == "masked_fill":
            has, at = find(node, "_saved_mask", True)
            if not has or at is None:
                return None
            ops.append(_fill_at(len(sources)))
            sources.append(at)
        elif kind == ADD_NODE:  # the added tensor: what it masked kept instead
            added = added or _added_mask(base, dim)
            if added[1] is not None:
                ops.append(added[1])
        else:
            scale = _constant(node, find)
            if scale is None:
                return None
            ops.append(_scaled(SCALE_NODES[kind], scale))
    place = placed(saved, base)

    def probabilities(*values: torch.Tensor) -> torch.Tensor:
        s = torch.bmm(values[0], values[1])
        for op in ops:
            s = op(s, *values)
        return torch.softmax(s.reshape(shape), dim, dtype=dtype)  # (bf16 in: f32)

    def fn(*values: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return place(probabilities(*values))

    def gain(*values: torch.Tensor | None) -> tuple[float, ...]:
        if any(v is None for v in values):  # (an operand packed: not at hand)
            return 1.0, 1.0
        return perturbation_gains(probabilities, values, (0, 1))  # type: ignore[arg-type]

    kept = None if added is None else added[0]
    return Derivation(fn, tuple(sources), "softmax", gain, kept, (0, 1), max_depth=MAX_DEPTH)


def _constant(node: Any, find: Find) -> float | None:
    """A scale's one-element constant, where the graph holds it outside the hooks (a
    Python number autograd wrapped); None otherwise."""
    hooked, _ = find(node, "_saved_other", True)
    if hooked:
        return None
    other = getattr(node, "_saved_other", None)
    if not isinstance(other, torch.Tensor) or other.numel() != 1 or other.dim():
        return None
    return float(other)


def _scaled(op: Callable[..., torch.Tensor], scale: float) -> Callable[..., torch.Tensor]:
    def scaled(s: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return op(s, scale)

    return scaled


def _fill_at(position: int) -> Callable[..., torch.Tensor]:
    def fill(s: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
        return s.masked_fill(values[position], float("-inf"))

    return fill


def _added_mask(
    base: torch.Tensor, dim: int
) -> tuple[torch.Tensor | None, Callable[..., torch.Tensor] | None]:
    """What stands for an added mask (the graph does not keep it), read off the
    probabilities ``base``: where they are 0 (filled with -inf) and the rows it covered
    whole (a large negative number added to every score, finfo.min as Hugging Face's: each
    such row comes out uniform; filled with 0), packed at 1 bit a value and a row, and the
    step that applies them; (None, None) where neither is there.

    Example:
        >>> p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
        >>> kept, step = _added_mask(p, -1)
        >>> kept.numel(), step(torch.ones(2, 3), kept)
        (1, tensor([[1., 1., -inf],
                [0., 0., 0.]]))
    """
    p = base.detach()
    zero = p.eq(0)
    uniform = torch.softmax(torch.zeros(p.shape[dim], dtype=p.dtype, device=p.device), 0)[0]
    rows = p.amax(dim, keepdim=True).eq(uniform)  # (max 1/n: every value 1/n)
    if not (bool(zero.any()) or bool(rows.any())):
        return None, None  # (the step adds 0 where it matters)
    kept = mask_pack(torch.cat([zero.reshape(-1), rows.reshape(-1)]))
    shape, row_shape = zero.shape, rows.shape  # (no tensor held: only the packed bits)
    numel = shape.numel()

    def fill(s: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
        bits = mask_unpack(values[-1], numel + row_shape.numel())
        s = s.reshape(shape).masked_fill(bits[:numel].view(shape), float("-inf"))
        return s.masked_fill(bits[numel:].view(row_shape), 0.0)

    return kept, fill


class SoftmaxChecks:
    """Per site, whether its probabilities were given back by their remaking from the
    exact operands on the last measuring step that had them at hand (none yet: not
    remade).

    Example:
        >>> checks = SoftmaxChecks()
        >>> checks.passed("attn:3")
        False
        >>> p = torch.tensor([0.25, 0.75])
        >>> checks.check("attn:3", lambda: p.clone(), p)
        True
        >>> checks.check("attn:3", lambda: p.flip(0), p), checks.passed("attn:3")
        (False, False)
    """

    def __init__(self) -> None:
        self._passed: dict[str, bool] = {}

    def passed(self, key: str) -> bool:
        return self._passed.get(key, False)

    def check(self, key: str, remade: Callable[[], torch.Tensor], saved: torch.Tensor) -> bool:
        """Compare ``remade()`` with ``saved`` (NaN where NaN), note and return whether
        they agree; an error while remaking counts as not."""
        try:
            with torch.no_grad():
                again = remade()
            ok = again.shape == saved.shape and torch.allclose(
                again, saved.detach(), rtol=CHECK_RTOL, atol=CHECK_ATOL, equal_nan=True
            )
        except (RuntimeError, ValueError, IndexError):
            ok = False
        self._passed[key] = bool(ok)
        return bool(ok)

    def forget(self) -> None:
        """Drop every verdict (the engine is removed; the next fit checks again)."""
        self._passed.clear()
