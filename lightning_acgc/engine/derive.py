"""Saved outputs remade from their op's saved input: activations, LayerNorm, BatchNorm.

GELU, SiLU and the other activations below save their input ``x`` for backward, and the
op after them (a transformer's second feed-forward Linear, SwiGLU's product) saves their
output ``y = f(x)`` too: the same values twice, compressed twice. LayerNorm saves its input,
its mean and 1/σ, and the Linear after it saves its output. A policy that sets
``derives_elementwise`` stores such a ``y`` as nothing: at unpack it is remade from what
``x``'s holder unpacks (an activation: ``f(x̂)``; a LayerNorm: ``(x̂ − μ)·(1/σ)·γ + β``
with its exact saved statistics). On BERT-base the GELU outputs were a fifth of acgc's
kept bytes, the LayerNorm outputs a ninth.

A training-mode BatchNorm saves its input and its per-channel mean and 1/σ too; the op
after it (a GELU, a Linear) may save its output, remade the same way. ResNet's
conv-BN-ReLU is the common case: the ReLU saves its output ``relu(BN(x))``, which the
next conv saves as its input. It is remade as ``relu(BN(x̂))`` with the ReLU's mask
(``y > 0``) kept exactly at 1 bit a value (``Derivation.kept``): the ReLU's backward
passes exactly the elements it passed, and the conv sees ``x``'s rounding through the
BatchNorm's scale. On ResNet-18 (quick) the ReLU outputs after ``bn1`` were a fifth of
acgc's kept bytes.

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
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_acgc.kernels.mask import mask_affine

__all__ = [
    "DERIVABLE_NODES",
    "ELEMENTWISE_NODES",
    "Derivation",
    "Origin",
    "derivative_gain",
    "derive_plan",
    "derived_output",
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
BATCH_NORM_NODE = "NativeBatchNormBackward0"  # training mode on CPU (not cuDNN's)
RELU_NODE = "ReluBackward0"  # saves its output: derived where its input is a BatchNorm's
DERIVABLE_NODES = frozenset({*ELEMENTWISE_NODES, LAYER_NORM_NODE, BATCH_NORM_NODE, RELU_NODE})


class Origin(NamedTuple):
    """Where a saved tensor came from, without holding it: the autograd node that made it
    and its output slot (or, for a leaf, the leaf itself), its shape, dtype and device."""

    node: object | None
    slot: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    leaf: torch.Tensor | None

    @classmethod
    def of(cls, t: torch.Tensor) -> Origin:
        node = t.grad_fn
        leaf = t if node is None and t.requires_grad else None
        return cls(node, t.output_nr if node is not None else 0, t.shape, t.dtype, t.device, leaf)

    def made(self, edge: tuple[object, int]) -> bool:
        """Whether the graph ``edge`` leads to this tensor (its node and output slot, or
        the leaf it accumulates into)."""
        node, slot = edge
        if node is None:
            return False
        if self.node is not None:
            return node is self.node and slot == self.slot
        return self.leaf is not None and getattr(node, "variable", None) is self.leaf

    def like(self, t: torch.Tensor) -> bool:
        return self.shape == t.shape and self.dtype == t.dtype and self.device == t.device


class Derivation(NamedTuple):
    """``fn(*values of recent[i] for i in sources)`` is the saved tensor (its sizes,
    strides and offset); ``gain(*the same values, raw)`` is the mean factor from the first
    source's rounding variance to the result's; ``name`` says what remakes it. Where
    ``kept`` is a tensor (a ReLU's mask, bool), the engine stores it packed at 1 bit a
    value (:func:`~lightning_acgc.kernels.mask.mask_pack`) and passes the packed bits to
    ``fn`` and ``gain`` after the sources' values."""

    fn: Callable[..., torch.Tensor]
    sources: tuple[int, ...]
    name: str
    gain: Callable[..., float]
    kept: torch.Tensor | None = None


def _placed(saved: torch.Tensor, base: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The view ``saved`` of the contiguous ``base``, taken of a tensor laid out as it."""
    size, stride = tuple(saved.shape), saved.stride()
    offset = saved.storage_offset() - base.storage_offset()
    return lambda out: out.contiguous().as_strided(size, stride, offset)


def _find(recent: list[Origin], edge: tuple[object, int], base: torch.Tensor) -> int | None:
    for i in range(len(recent) - 1, -1, -1):
        if recent[i].like(base) and recent[i].made(edge):
            return i
    return None


def _activation(saved: torch.Tensor, base: torch.Tensor, recent: list[Origin]) -> Derivation | None:
    node = base.grad_fn
    if len(node.next_functions) != 1:  # type: ignore[union-attr]
        return None
    i = _find(recent, node.next_functions[0], base)  # type: ignore[union-attr]
    if i is None:
        return None
    forward, place = ELEMENTWISE_NODES[type(node).__name__](node), _placed(saved, base)

    def fn(x_hat: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return place(forward(x_hat))

    return Derivation(fn, (i,), forward.__name__, lambda x: derivative_gain(forward, x))


def _affine(edge: tuple[object, int]) -> torch.Tensor | bool | None:
    """The parameter a LayerNorm's weight or bias edge accumulates into; None where it has
    none; False where it is computed (not a leaf: not remade)."""
    node = edge[0]
    if node is None:
        return None
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else False


def _layer_norm(saved: torch.Tensor, base: torch.Tensor, recent: list[Origin]) -> Derivation | None:
    node = base.grad_fn
    edges = node.next_functions  # type: ignore[union-attr]
    if len(edges) != 3 or base.dtype not in (torch.float32, torch.float64):
        return None
    i = _find(recent, edges[0], base)
    weight, bias = _affine(edges[1]), _affine(edges[2])
    if i is None or weight is False or bias is False:
        return None
    ndim = len(node._saved_normalized_shape)  # type: ignore[union-attr]
    stat_shape = (*base.shape[: base.dim() - ndim], *(1,) * ndim)
    # the statistics are saved right after the input (and the bias): mean, then 1/σ
    stats = [
        j
        for j in range(i + 1, len(recent))
        if recent[j].node is None and recent[j].leaf is None and recent[j].shape == stat_shape
    ][:2]
    if len(stats) != 2 or stats[1] != stats[0] + 1:
        return None
    place = _placed(saved, base)

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


def _batch_norm_parts(node: object, base: torch.Tensor, recent: list[Origin]) -> tuple | None:
    """A training-mode BatchNorm's input (index in ``recent``), its mean and 1/σ (the
    indices), weight and bias; None where they are not the last tensors saved.

    The BatchNorm saves its input, its running mean and variance (where it tracks them),
    its weight, then the batch's mean and 1/σ (one value per channel, dimension 1); after
    them only parameters (a leaf: the next op's weight) may have been saved."""
    edges = node.next_functions  # type: ignore[attr-defined]
    if len(edges) != 3 or base.dim() < 2 or base.dtype not in (torch.float32, torch.float64):
        return None
    if not bool(node._saved_training):  # type: ignore[attr-defined]  # eval: running stats
        return None
    i = _find(recent, edges[0], base)
    weight, bias = _affine(edges[1]), _affine(edges[2])
    if i is None or weight is False or bias is False:
        return None
    channels = (base.shape[1],)
    stats = []
    for j in range(i + 1, len(recent)):
        if recent[j].node is None and recent[j].leaf is None and recent[j].shape == channels:
            stats.append(j)
        elif recent[j].leaf is None:  # a computed tensor: something else ran in between
            return None
    if len(stats) not in (2, 4) or stats[-1] != stats[-2] + 1:
        return None
    return i, (stats[-2], stats[-1]), weight, bias


def _scale_shift(
    mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, ``scale`` and ``shift`` of ``(x − mean)·rstd·weight + bias``."""
    scale = rstd if weight is None else rstd * weight.detach()
    shift = -mean * scale if bias is None else bias.detach() - mean * scale
    return scale, shift


def _normalized(
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``(x − mean)·rstd·weight + bias`` per channel (dimension 1), as one pass over
    ``x``: ``x·scale + shift``."""
    shape = (1, -1, *(1,) * (x.dim() - 2))
    scale, shift = _scale_shift(mean, rstd, weight, bias)
    return torch.addcmul(shift.view(shape), x, scale.view(shape))


def _channel_gain(rstd: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """Per channel, the factor (rstd·γ)² from the input's rounding variance to the
    output's (float64)."""
    g = rstd.detach().double().square()
    return g * weight.detach().double().square() if weight is not None else g


def _batch_norm(saved: torch.Tensor, base: torch.Tensor, recent: list[Origin]) -> Derivation | None:
    parts = _batch_norm_parts(base.grad_fn, base, recent)
    if parts is None:
        return None
    i, stats, weight, bias = parts
    place = _placed(saved, base)

    def fn(x_hat: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return place(_normalized(x_hat, mean, rstd, weight, bias))

    def gain(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> float:
        return float(_channel_gain(rstd, weight).mean())

    return Derivation(fn, (i, *stats), "batch_norm", gain)


def _relu_of_batch_norm(
    saved: torch.Tensor, base: torch.Tensor, recent: list[Origin]
) -> Derivation | None:
    """A ReLU's output whose input is a training-mode BatchNorm's output (ResNet's
    conv-BN-ReLU): remade as ``relu(BN(x̂))`` from the BatchNorm's input, with its mask
    (``y > 0``, and NaN) kept exactly, so the ReLU's backward passes the same elements
    and a value the mask keeps is never rounded to zero."""
    edges = base.grad_fn.next_functions  # type: ignore[union-attr]
    norm = edges[0][0] if len(edges) == 1 and edges[0][1] == 0 else None
    if type(norm).__name__ != BATCH_NORM_NODE:
        return None
    parts = _batch_norm_parts(norm, base, recent)
    if parts is None:
        return None
    i, stats, weight, bias = parts
    place, tiny = _placed(saved, base), torch.finfo(base.dtype).tiny
    with torch.no_grad():
        mask = ~(base <= 0)  # NaN passes: it stays NaN

    def fn(x_hat: Tensor, mean: Tensor, rstd: Tensor, bits: Tensor) -> Tensor:
        with torch.no_grad():
            scale, shift = _scale_shift(mean, rstd, weight, bias)
            return place(mask_affine(x_hat, scale, shift, bits, tiny))

    def gain(x: Tensor, mean: Tensor, rstd: Tensor, bits: Tensor) -> float:
        with torch.no_grad():  # from the mask at hand (``bits`` is its packed copy)
            passed = mask.sum(dim=[d for d in range(mask.dim()) if d != 1]).double()
            return float((passed * _channel_gain(rstd, weight)).sum() / max(mask.numel(), 1))

    return Derivation(fn, (i, *stats), "relu of batch_norm", gain, kept=mask)


def derived_output(saved: torch.Tensor) -> bool:
    """Whether ``saved`` (or the tensor it is a view of) is an activation's, a norm's or
    a ReLU's output that :func:`derive_plan` may remake (a cheap test, before any
    search)."""
    base = saved if saved._base is None else saved._base
    kind = type(base.grad_fn).__name__
    if kind == RELU_NODE:  # every ReLU output saved: only one of a BatchNorm's is remade
        edges = base.grad_fn.next_functions  # type: ignore[union-attr]
        return len(edges) == 1 and type(edges[0][0]).__name__ == BATCH_NORM_NODE
    return kind in DERIVABLE_NODES


def derive_plan(saved: torch.Tensor, recent: list[Origin]) -> Derivation | None:
    """How to remake the saved tensor ``saved`` (an activation's, a LayerNorm's or a
    training-mode BatchNorm's output, a ReLU's output of a BatchNorm, or a view of one)
    from tensors saved before it (``recent``, oldest first); None where it is not such an
    output, its input is not among them, or the output is not contiguous."""
    if not derived_output(saved):
        return None
    base = saved if saved._base is None else saved._base
    if not base.is_contiguous():
        return None
    kind = type(base.grad_fn).__name__
    if kind == LAYER_NORM_NODE:
        return _layer_norm(saved, base, recent)
    if kind == BATCH_NORM_NODE:
        return _batch_norm(saved, base, recent)
    if kind == RELU_NODE:
        return _relu_of_batch_norm(saved, base, recent)
    return _activation(saved, base, recent)


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
