"""Parameters saved as copies in another dtype: what autocast (``precision="bf16-mixed"``)
hands an op in place of its float32 weight, and what the op then saves.

Such a copy is the weight as the op used it, not an activation: a lossy copy changes
every gradient that flows through the op (a 7-bit copy of a ResNet's fc weight alone put
a bf16-mixed calibration at half its error budget before anything else was compressed).
Nor need it be held: the engine stores nothing for it and casts the parameter again at
unpack (the same rounding: bit-identical), so that autocast's weight copies cost the
step no memory, as the parameters themselves in float32 training ("cast again from its
parameter" in the per-site table). A copy of a parameter that takes a gradient carries
the cast in its graph (:func:`cast_parameter`); a frozen parameter's copy (a LoRA
fine-tune's base weights) has no graph, and is recognised by its shape and values
(:class:`FrozenParameters`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FrozenParameters", "cast_parameter", "cast_source"]

_SAMPLES = 64  # values compared to tell a frozen parameter's copy


def cast_parameter(t: torch.Tensor) -> torch.Tensor | None:
    """The parameter ``t`` (or the tensor it views) is a cast of, for this forward,
    where it is one that takes a gradient; else None.

    Example:
        >>> w = torch.nn.Parameter(torch.randn(4, 4))
        >>> cast_parameter(w.to(torch.bfloat16).t()) is w, cast_parameter(w * 2)
        (True, None)
    """
    return cast_source((t._base if t._base is not None else t).grad_fn)


def cast_source(node: object) -> torch.Tensor | None:
    """The leaf that the autograd node ``node`` casts (a ``ToCopyBackward0`` whose input
    accumulates into a parameter); else None.

    Example:
        >>> w = torch.nn.Parameter(torch.randn(2))
        >>> cast_source(w.half().grad_fn) is w, cast_source((w * 2).grad_fn)
        (True, None)
    """
    if type(node).__name__ != "ToCopyBackward0":
        return None
    (edge,) = node.next_functions  # type: ignore[attr-defined]
    variable = getattr(edge[0], "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


class FrozenParameters:
    """The floating parameters of ``model`` that take no gradient, by shape, read again
    after :meth:`refresh` (a fit may freeze or unfreeze them between steps).

    Example:
        >>> base = torch.nn.Linear(4, 3).requires_grad_(False)
        >>> frozen = FrozenParameters(base)
        >>> frozen.copied(base.weight.to(torch.bfloat16).t()) is base.weight
        True
        >>> frozen.copied(torch.zeros(3, 4, dtype=torch.bfloat16)) is None
        True
    """

    def __init__(self, model: nn.Module | None) -> None:
        self._model = model
        self._by_shape: dict[tuple[int, ...], list[torch.Tensor]] | None = None

    def refresh(self) -> None:
        """Read the model's frozen parameters again on the next :meth:`copied`."""
        self._by_shape = None

    def source(self, t: torch.Tensor) -> torch.Tensor | None:
        """The parameter ``t`` is a copy of in another dtype, trained
        (:func:`cast_parameter`) or frozen (:meth:`copied`); else None."""
        return cast_parameter(t) if t.grad_fn is not None else self.copied(t)

    def copied(self, t: torch.Tensor) -> torch.Tensor | None:
        """The frozen parameter ``t`` (or the tensor it views, without a graph) holds
        the values of, cast to ``t``'s other dtype (compared on up to 64 evenly spaced
        values: a saved activation without history of exactly that shape and those
        values is not met in practice); else None."""
        if t.grad_fn is not None or t.requires_grad or self._model is None:
            return None
        base = t._base if t._base is not None else t
        if not base.is_floating_point() or base.numel() == 0:
            return None
        if self._by_shape is None:
            self._by_shape = {}
            for p in self._model.parameters():
                if not p.requires_grad and p.is_floating_point() and p.numel():
                    self._by_shape.setdefault(tuple(p.shape), []).append(p)
        for p in self._by_shape.get(tuple(base.shape), ()):
            if p.dtype != base.dtype and p.device == base.device and _same_values(p, base):
                return p
        return None


def _same_values(param: torch.Tensor, copy: torch.Tensor) -> bool:
    flat, n = copy.reshape(-1), copy.numel()
    at = torch.arange(0, n, max(1, n // _SAMPLES), device=copy.device)[:_SAMPLES]
    with torch.no_grad():
        want = param.detach().reshape(-1)[at].to(copy.dtype)
        return bool(torch.equal(want, flat[at]))
