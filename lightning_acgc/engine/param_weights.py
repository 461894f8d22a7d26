"""Weights computed from parameters on each forward: ``torch.nn.utils.parametrize``'s
(``weight_norm``, ``spectral_norm``, ``orthogonal``, a user's own parametrization).

An op saves such a weight as it saves an activation (it is no leaf), but it is the
weight the op used, not an activation: its size does not grow with the batch, and a
lossy copy changes every gradient that flows back through the op. Compressed, a
weight-normed 1-D convolution stack (a vocoder's) measured 144x the error its model
predicted and a layer over its budget, and acgc kept it at 6.7x where the same stack
without the parametrization reaches 36x. The engine keeps these weights as they are,
whatever the policy (reason "computed weight" in the per-site table), as plain autograd
holds them, and so what a parametrization saves while it computes one (weight norm's
norms: weight-sized too).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

__all__ = ["ComputedWeights"]


class ComputedWeights:
    """The outputs of ``model``'s parametrizations this step, and whether one is running,
    while installed.

    Example:
        >>> linear = nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
        >>> weights = ComputedWeights(linear); weights.install()
        >>> w = linear.weight
        >>> weights.holds(w), weights.holds(w.t()), weights.holds(torch.ones(3, 4))
        (True, True, False)
        >>> seen = []
        >>> def pack(t):
        ...     seen.append(weights.holds(t))
        ...     return t
        >>> with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ...     _ = linear(torch.ones(2, 4, requires_grad=True))
        >>> any(seen[:-2]), seen[-2:]  # saved computing the weight; then x and the weight
        (True, [False, True])
        >>> weights.remove(); weights.holds(w)
        False
    """

    def __init__(self, model: nn.Module | None) -> None:
        self._model = model
        self._handles: list[RemovableHandle] = []
        self._made: dict[int, weakref.ref[torch.Tensor]] = {}  # storage pointer -> output
        self._running = 0  # parametrizations computing now

    def install(self) -> None:
        if self._handles or self._model is None:
            return
        for module in self._model.modules():
            if isinstance(module, parametrize.ParametrizationList):
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._made_one, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._made.clear()
        self._running = 0

    def new_step(self) -> None:
        self._made.clear()
        self._running = 0

    def _enter(self, module: nn.Module, args: object) -> None:
        self._running += 1

    def _made_one(self, module: nn.Module, args: object, output: object) -> None:
        self._running = max(self._running - 1, 0)
        if isinstance(output, torch.Tensor) and output.layout == torch.strided:
            self._made[output.untyped_storage().data_ptr()] = weakref.ref(output)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is saved while a parametrization runs, or is (a view of) a weight
        one made this step (and still alive: its storage not reused)."""
        if self._running:
            return True
        if not self._made or t.layout != torch.strided:
            return False
        made = self._made.get(t.untyped_storage().data_ptr())
        return made is not None and made() is not None
