"""A fused attention's output, remade: ``softmax(q·kᵀ·scale + mask)·v`` run again at
unpack from what the holders of its query, key and value unpack (see
:mod:`lightning_acgc.engine.derive`).

PyTorch's fused attention on CPU (``scaled_dot_product_attention``, the flash kernel)
saves its output for backward (``D = rowsum(dO·O)``), and the output projection after it
saves the same values as its input (one holder: :mod:`~.derive_view`). On a Llama
(SmolLM-135M's dimensions) that output was the largest tensor acgc stored, at 16 bits on
25 of 30 layers: the kernel's backward reads ``O`` through ``dS = P·(dP − D)``, where
the rows of ``dS`` sum to zero only with ``D`` of the same ``P`` that ``O`` was made of,
so a rounded ``O`` sends an error into the query's gradient along the keys' mean. Made
again from the (remade) q, k and v it is the attention of those values, its ``D``
consistent with them; it costs the attention's forward once more (a few percent of a
decoder layer's multiplies at a sequence of 256).

The error reaches the result from the three holders (``Derivation.roots``); each gain
(the mean factor from a root's rounding variance to the output's) is measured on the
policy's measuring steps by running the attention again on the root perturbed by a small
Gaussian (float32, the output's change's mean square over the perturbation's variance).
A mask, where the attention has one, must give its values back exactly; with dropout
(random draws not kept) the output is not remade. CUDA's kernels (flash, memory-efficient,
cuDNN) keep other tensors: their outputs are stored as before.

Example:
    >>> q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    >>> out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> holders = {"_saved_query": (True, 0), "_saved_key": (True, 1),
    ...            "_saved_value": (True, 2), "_saved_attn_mask": (False, None)}
    >>> plan = attention_output(out, out, lambda node, attr, exact: holders[attr])
    >>> plan.name, plan.sources, torch.equal(plan.fn(q, k, v), out.detach())
    ('attention', (0, 1, 2), True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_acgc.engine.derive_graph import Derivation, dense_order, perturbation_gains, placed

__all__ = ["ATTENTION_NODE", "attention_output", "fused_attention"]

ATTENTION_NODE = "ScaledDotProductFlashAttentionForCpuBackward0"
# (node, attr, exact) -> (whether the node saved a tensor there, the position in ``recent``
# of its holder where that holder gives the values back; ``exact``: exactly)
Find = Callable[[object, str, bool], "tuple[bool, int | None]"]
# the deepest remaking the sources may be (Derivation.max_depth): a rotated query of a
# projection of a norm's output run again (Llama's), a view of a product (GPT-2's split);
# no unpack runs a chain of attentions back through the model
MAX_DEPTH = 3


def fused_attention(base: torch.Tensor) -> bool:
    """A cheap test: ``base`` is the output of PyTorch's fused attention on CPU."""
    return type(base.grad_fn).__name__ == ATTENTION_NODE and base.output_nr == 0


def attention_output(saved: torch.Tensor, base: torch.Tensor, find: Find) -> Derivation | None:
    """How to remake ``saved`` (a view of ``base``, the fused attention's output) from the
    holders of the attention's query, key and value (and of its mask, one that unpacks
    exactly) that ``find`` gives; None where one is not there, the attention drew
    dropout, or ``base`` is not laid out densely."""
    node = base.grad_fn
    if not fused_attention(base) or float(node._saved_dropout_p) != 0.0:  # type: ignore[union-attr]
        return None
    if not base.is_contiguous() and dense_order(base) is None:
        return None
    found = [find(node, f"_saved_{name}", False) for name in ("query", "key", "value")]
    has_mask, mask_at = find(node, "_saved_attn_mask", True)
    positions = [i for _, i in found]
    if any(i is None for i in positions) or (has_mask and mask_at is None):
        return None
    causal, scale = bool(node._saved_is_causal), node._saved_scale  # type: ignore[union-attr]
    scale = None if scale is None else float(scale)
    place = placed(saved, base)

    def attend(*qkv_mask: torch.Tensor) -> torch.Tensor:
        q, k, v, *mask = qkv_mask
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask[0] if mask else None, scale=scale
        )[0]

    def fn(*values: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return place(attend(*values))

    def gain(*values: torch.Tensor | None) -> tuple[float, ...]:
        if any(v is None for v in values):  # (a mask packed losslessly: not at hand)
            return 1.0, 1.0, 1.0
        return perturbation_gains(attend, values, (0, 1, 2))  # type: ignore[arg-type]

    sources = (*positions, *([mask_at] if has_mask else []))
    return Derivation(
        fn,
        sources,
        "attention",
        gain,
        roots=(0, 1, 2),
        max_depth=MAX_DEPTH,  # type: ignore[arg-type]
    )
