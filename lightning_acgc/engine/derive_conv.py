"""Convolution outputs remade from the convolution's saved input: a ResNet's BatchNorm
inputs.

A training-mode BatchNorm saves its input, the output of the convolution before it;
that convolution saved its own input too. Where the policy derives outputs, the
BatchNorm's input is stored as nothing and made again at unpack by the same convolution
of what the convolution's input holder unpacks. The price is the convolution once more
in backward. A chain of such remakings would run the network again from its first
stored tensor at every unpack; so a convolution's output is remade only where its input
is stored, or remade from stored tensors by a cheap op (a ReLU of a BatchNorm): in a
bottleneck block the last 1x1 convolution's output (the widest BatchNorm input) is
remade from the stored input of the BatchNorm before it.

``y``'s error is the convolution of ``x``'s: for rounding errors independent across
``x``'s values, ``‖W‖²_F / out_channels`` times their variance (:func:`conv_gain`).

Example:
    >>> from lightning_acgc.engine.derive_graph import Origin
    >>> conv = torch.nn.Conv2d(3, 4, 3, padding=1, stride=2)
    >>> x = torch.randn(2, 3, 8, 8, requires_grad=True) * 1.0
    >>> y = conv(x)
    >>> plan = conv_output(y, y, [Origin.of(x)])
    >>> plan.name, torch.allclose(plan.fn(x.detach()), y.detach())
    ('conv', True)
"""

from __future__ import annotations

import torch

from lightning_acgc.engine.derive_graph import (
    Derivation,
    Origin,
    check_unchanged,
    placed,
    used_param,
)

__all__ = ["CONV_NODE", "conv_gain", "conv_output"]

CONV_NODE = "ConvolutionBackward0"


def conv_gain(weight: torch.Tensor) -> float:
    """``‖W‖²_F / out_channels``: the mean factor from the variance of errors independent
    across a convolution's input values to its output's (away from the padding).

    Example:
        >>> conv_gain(torch.full((4, 2, 3, 3), 0.5))
        4.5
    """
    with torch.no_grad():
        w = weight.detach().double()
        return float(w.square().sum() / max(1, w.shape[0]))


def conv_output(saved: torch.Tensor, base: torch.Tensor, recent: list[Origin]) -> Derivation | None:
    """How to remake ``saved`` (a view of ``base``, a convolution's output) from the
    convolution's input among ``recent``; None where it is not one, its input is not
    there, it is transposed, or its weight or bias is not a parameter (used as it is, or
    cast by autocast: :func:`~lightning_acgc.engine.derive_graph.used_param`)."""
    node = base.grad_fn
    if type(node).__name__ != CONV_NODE or base.output_nr != 0:
        return None
    if bool(node._saved_transposed):  # type: ignore[union-attr]
        return None
    edges = node.next_functions  # type: ignore[union-attr]
    weight = used_param(edges[1])
    has_bias = tuple(node._saved_bias_sym_sizes_opt or (0,)) != (0,)  # type: ignore[union-attr]
    bias = used_param(edges[2]) if has_bias else None
    if not isinstance(weight, torch.Tensor) or bias is False or (has_bias and bias is None):
        return None
    found = [
        i
        for i in range(len(recent) - 1, -1, -1)
        if recent[i].made(edges[0]) and recent[i].dtype == base.dtype
    ]
    if not found:
        return None
    args = tuple(
        tuple(int(v) for v in getattr(node, f"_saved_{name}"))
        for name in ("stride", "padding", "dilation", "output_padding")
    )
    groups = int(node._saved_groups)  # type: ignore[union-attr]
    stride, padding, dilation, output_padding = args
    view = placed(saved, base)
    unchanged = check_unchanged("a convolution's weight or bias", weight, bias)
    dtype = base.dtype  # (not ``base`` in the closure: it would hold the output alive)

    def fn(x_hat: torch.Tensor) -> torch.Tensor:
        unchanged()
        with torch.no_grad():  # (the casts: autocast's, see used_param; else no-ops)
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            y = torch.ops.aten.convolution(
                x_hat, w, b, stride, padding, dilation, False, output_padding, groups
            )
            return view(y)

    def gain(x: torch.Tensor | None) -> float:
        return conv_gain(weight)

    return Derivation(fn, (found[0],), "conv", gain, multiplies=weight[0].numel())
