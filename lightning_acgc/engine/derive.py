"""Saved outputs remade from their op's saved input: activations, LayerNorm, BatchNorm.

GELU, SiLU and the other activations below save their input ``x`` for backward, and the
op after them (a transformer's second feed-forward Linear, SwiGLU's product) saves their
output ``y = f(x)`` too: the same values twice, compressed twice. LayerNorm saves its input,
its mean and 1/σ, and the Linear after it saves its output. A policy that sets
``derives_elementwise`` stores such a ``y`` as nothing: at unpack it is remade from what
``x``'s holder unpacks (an activation: ``f(x̂)``; a LayerNorm: ``(x̂ − μ)·(1/σ)·γ + β``
with its exact saved statistics). On BERT-base the GELU outputs were a fifth of acgc's
kept bytes, the LayerNorm outputs a ninth.

Training-mode BatchNorm outputs, and ReLU outputs of a BatchNorm (ResNet's conv-BN-ReLU,
with the ReLU's mask kept exactly), are remade the same way: see
:mod:`lightning_acgc.engine.derive_batch_norm`. So are Linear outputs (an attention's q, k
and v, a feed-forward's pre-activation) from the Linear's saved input, with the product
made again: see :mod:`lightning_acgc.engine.derive_linear`; a convolution's output that
a BatchNorm saves: see :mod:`lightning_acgc.engine.derive_conv`; and a dropout's output
from its input and its mask: see :mod:`lightning_acgc.engine.derive_dropout`; autocast's
16-bit copy of an activation's, a LayerNorm's or a dropout's output, cast again from the
output remade: see :mod:`lightning_acgc.engine.derive_cast`.

``y``'s error is then ``f'(x)·(x̂ − x)`` (LayerNorm: ``(x̂ − x)·γ/σ``): ``x``'s rounding
times ``f'(x)²`` in variance. :attr:`Derivation.gain` measures that factor's mean (about
0.5 for a GELU of centred values), and the error model charges ``y``'s sensitivity to
``x`` times it, so one width serves both tensors.

Example:
    >>> x = torch.randn(4, 6, requires_grad=True)
    >>> h = x * 2
    >>> y = torch.nn.functional.gelu(h)
    >>> plan = derive_plan(y, [Origin.of(x), Origin.of(h)])
    >>> plan.sources, plan.name, torch.allclose(plan.fn(h.detach()), y.detach())
    ((1,), 'gelu', True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightning_acgc.engine.derive_batch_norm import (
    ADD_NODE,
    BATCH_NORM_NODE,
    RELU_NODE,
    batch_norm_output,
    relu_output,
)
from lightning_acgc.engine.derive_cast import CAST_NODE, Unsaved, cast_output, casts_activation
from lightning_acgc.engine.derive_conv import CONV_NODE, conv_output
from lightning_acgc.engine.derive_dropout import (
    MUL_NODE,
    NATIVE_DROPOUT_NODE,
    Locate,
    dropout_output,
    scaled,
    scaled_node,
)
from lightning_acgc.engine.derive_gated import gated, gated_output
from lightning_acgc.engine.derive_graph import Derivation, Origin, affine_param, find, placed
from lightning_acgc.engine.derive_linear import (
    LAYOUT_NODES,
    LINEAR_NODES,
    linear_output,
    made_by_linear,
)

__all__ = [
    "DERIVABLE_NODES",
    "ELEMENTWISE_NODES",
    "Derivation",
    "Origin",
    "derivative_gain",
    "derive_plan",
    "derived_output",
    "unsaved_like",
]

Fn = Callable[[torch.Tensor], torch.Tensor]


def _gelu(node: object) -> Fn:
    approximate = str(node._saved_approximate)  # type: ignore[attr-defined]

    def gelu(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=approximate)

    return gelu


def _leaky(node: object) -> Fn:
    slope = float(node._saved_negative_slope)  # type: ignore[attr-defined]

    def leaky_relu(x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, slope)

    return leaky_relu


def _softplus(node: object) -> Fn:
    beta, threshold = float(node._saved_beta), float(node._saved_threshold)  # type: ignore[attr-defined]

    def softplus(x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x, beta, threshold)

    return softplus


def _elu(node: object) -> Fn:
    alpha, scale = float(node._saved_alpha), float(node._saved_scale)  # type: ignore[attr-defined]
    input_scale = float(node._saved_input_scale)  # type: ignore[attr-defined]

    def elu(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.elu(x, alpha, scale, input_scale)

    return elu


# autograd nodes of activations that save their input (never their output), and their
# forward made from the node's non-tensor attributes (reading a saved tensor would unpack it)
ELEMENTWISE_NODES: dict[str, Callable[[object], Fn]] = {
    "GeluBackward0": _gelu,
    "SiluBackward0": lambda node: F.silu,
    "MishBackward0": lambda node: F.mish,
    "HardswishBackward0": lambda node: F.hardswish,
    "LeakyReluBackward0": _leaky,
    "SoftplusBackward0": _softplus,
    "EluBackward0": _elu,
}
LAYER_NORM_NODE = "NativeLayerNormBackward0"
DERIVABLE_NODES = frozenset({*ELEMENTWISE_NODES, LAYER_NORM_NODE, BATCH_NORM_NODE, RELU_NODE})
# what a saved cast may be remade from (derive_cast): an output no op saved (MUL_NODE: a
# dropout's x·mask, where one factor has no history)
DROPOUT_NODES = frozenset({NATIVE_DROPOUT_NODE, MUL_NODE})
CAST_SOURCES = frozenset({*ELEMENTWISE_NODES, LAYER_NORM_NODE, *DROPOUT_NODES})


def _activation(
    saved: torch.Tensor | None, base: torch.Tensor, recent: list[Origin], node: object = None
) -> Derivation | None:
    """(With ``saved`` None, ``base`` stands for a tensor alike made by ``node`` that no
    op saved, remade contiguous: see :func:`unsaved_input`; so for :func:`_layer_norm`.)"""
    node = node or base.grad_fn
    if len(node.next_functions) != 1:  # type: ignore[attr-defined]
        return None
    i = find(recent, node.next_functions[0], base)  # type: ignore[attr-defined]
    if i is None:
        return None
    forward = ELEMENTWISE_NODES[type(node).__name__](node)
    place = placed(saved, base) if saved is not None else _as_is

    def fn(x_hat: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return place(forward(x_hat))

    def gain(x: torch.Tensor | None) -> float:
        return 1.0 if x is None else derivative_gain(forward, x)

    return Derivation(fn, (i,), forward.__name__, gain)


def _layer_norm(
    saved: torch.Tensor | None, base: torch.Tensor, recent: list[Origin], node: object = None
) -> Derivation | None:
    node = node or base.grad_fn
    edges = node.next_functions  # type: ignore[attr-defined]
    if len(edges) != 3 or base.dtype not in (torch.float32, torch.float64):
        return None
    i = find(recent, edges[0], base)
    weight, bias = affine_param(edges[1]), affine_param(edges[2])
    if i is None or weight is False or bias is False:
        return None
    ndim = len(node._saved_normalized_shape)  # type: ignore[attr-defined]
    stat_shape = (*base.shape[: base.dim() - ndim], *(1,) * ndim)
    # the statistics are saved right after the input (and the bias): mean, then 1/σ
    stats = [
        j
        for j in range(i + 1, len(recent))
        if recent[j].node is None
        and recent[j].leaf is None
        and recent[j].shape == stat_shape
        and recent[j].dtype.is_floating_point
    ][:2]
    if len(stats) != 2 or stats[1] != stats[0] + 1:
        return None
    place = placed(saved, base) if saved is not None else _as_is

    def fn(x_hat: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = (x_hat - mean) * rstd
            out = out * weight if weight is not None else out
            return place(out + bias if bias is not None else out)

    def gain(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> float:
        with torch.no_grad():
            g = rstd.double().square().mean()
            if weight is not None:
                g = g * weight.detach().double().square().mean()
        return float(g)

    return Derivation(fn, (i, *stats), "layer_norm", gain)


def _as_is(out: torch.Tensor) -> torch.Tensor:
    return out


def unsaved_input(
    node: object, slot: int, like: torch.Tensor, recent: list[Origin]
) -> Derivation | None:
    """How to remake, contiguous, a tensor that no op saved, made by ``node`` (output
    ``slot``) with ``like``'s shape, dtype and device: an activation's or a LayerNorm's
    output, from their inputs in ``recent`` (a dropout's input, which the dropout does
    not save: see :mod:`lightning_acgc.engine.derive_dropout`)."""
    kind = type(node).__name__
    if slot != 0 or not like.is_contiguous():
        return None
    if kind == LAYER_NORM_NODE:
        return _layer_norm(None, like, recent, node)
    if kind in ELEMENTWISE_NODES:
        return _activation(None, like, recent, node)
    return None


def unsaved_like(like: Unsaved, recent: list[Origin]) -> Derivation | None:
    """:func:`unsaved_input` of the tensor ``like`` stands for."""
    return unsaved_input(like.grad_fn, like.output_nr, like, recent)  # type: ignore[arg-type]


def derived_output(saved: torch.Tensor) -> bool:
    """Whether ``saved`` (or the tensor it is a view of) is an activation's, a norm's or
    a ReLU's output that :func:`derive_plan` may remake (a cheap test, before any
    search)."""
    base = saved if saved._base is None else saved._base
    kind = type(base.grad_fn).__name__
    if kind == CAST_NODE:  # autocast's copy of an activation (derive_cast)
        if not casts_activation(base, CAST_SOURCES):
            return False
        inner = base.grad_fn.next_functions[0][0]  # type: ignore[union-attr]
        return type(inner).__name__ != MUL_NODE or scaled_node(inner)  # (x·mask only)
    if kind == RELU_NODE:  # every ReLU output saved: only those of a BatchNorm or a sum
        edges = base.grad_fn.next_functions  # type: ignore[union-attr]
        return len(edges) == 1 and type(edges[0][0]).__name__ in (BATCH_NORM_NODE, ADD_NODE)
    if kind in LINEAR_NODES or kind in LAYOUT_NODES:
        return made_by_linear(base)
    return kind in DERIVABLE_NODES or kind == CONV_NODE or scaled(base) or gated(base)


def derive_plan(
    saved: torch.Tensor,
    recent: list[Origin],
    locate: Locate | None = None,
    products: bool = True,
) -> Derivation | None:
    """How to remake the saved tensor ``saved`` (an activation's, a LayerNorm's or a
    training-mode BatchNorm's output, a ReLU's output of a BatchNorm, a Linear's product
    after view, transpose and copy steps, a convolution's output, a dropout's output, or
    a view of one) from tensors saved before it (``recent``, oldest first); None where it
    is not such an output, its input is not among them, or the output is not contiguous.
    ``locate(node, attr)``: the position in ``recent`` of the holder autograd keeps for
    ``node``'s saved ``attr``, where it gives the values back exactly (a dropout's mask;
    None: no dropout output is remade). ``products=False``: no Linear's or convolution's
    output is remade (``EngineSettings.remake_products``)."""
    base = saved if saved._base is None else saved._base
    kind = type(base.grad_fn).__name__
    if kind in LINEAR_NODES or kind in LAYOUT_NODES:  # (one walk of the layout chain)
        return linear_output(saved, base, recent) if products and base.is_contiguous() else None
    if kind == CAST_NODE:
        return _cast(saved, base, recent, locate) if derived_output(saved) else None
    if not derived_output(saved) or not base.is_contiguous():
        return None
    if kind == LAYER_NORM_NODE:
        return _layer_norm(saved, base, recent)
    if kind == BATCH_NORM_NODE:
        return batch_norm_output(saved, base, recent)
    if kind == RELU_NODE:
        return relu_output(saved, base, recent)
    if kind == CONV_NODE:
        return conv_output(saved, base, recent) if products else None
    if gated(base):  # a·b, both saved (derive_gated)
        return gated_output(saved, base, recent)
    if scaled(base):
        if locate is None:
            return None
        return dropout_output(saved, base, recent, locate, unsaved_input)
    return _activation(saved, base, recent)


def _cast(
    saved: torch.Tensor, base: torch.Tensor, recent: list[Origin], locate: Locate | None
) -> Derivation | None:
    """A saved cast of an activation's, a LayerNorm's or a dropout's output (derive_cast)."""
    if type(base.grad_fn.next_functions[0][0]).__name__ not in DROPOUT_NODES:  # type: ignore[union-attr]
        return cast_output(saved, base, recent, unsaved_like)
    if locate is None:
        return None

    def dropped(like: Unsaved, recent: list[Origin]) -> Derivation | None:
        # (x·mask only: derived_output has told it from a product of two activations)
        return dropout_output(like, like, recent, locate, unsaved_input)  # type: ignore[arg-type]

    return cast_output(saved, base, recent, dropped)


def derivative_gain(fn: Fn, x: torch.Tensor, samples: int = 4096) -> float:
    """Mean ``f'(x)²`` over an evenly spaced sample of ``x``'s finite values (central
    differences in float64): the factor from ``x``'s rounding variance to ``f(x)``'s.
    1.0 where no value is finite.

    Example:
        >>> round(derivative_gain(torch.nn.functional.silu, torch.zeros(100)), 3)
        0.25
    """
    flat = x.detach().reshape(-1)
    step = max(1, flat.numel() // samples)
    with torch.no_grad():
        xs = flat[::step].double()
        xs = xs[torch.isfinite(xs)]
        if not xs.numel():
            return 1.0
        h = 1e-4 * xs.abs().clamp_min(1.0)
        slope = (fn(xs + h) - fn(xs - h)) / (2 * h)
    return float((slope * slope).mean())
