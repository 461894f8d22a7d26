"""A calibration step of accumulated batches, read on its last batch.

With gradient accumulation a step's gradient is the mean of ``k`` batches' and the
policy's calibration sees it whole, but only the last batch runs under the settings the
calibration chose: the earlier ones ran before the step's exact gradient was complete,
under the settings in force before. So the step's error is read on the last batch alone:
its compressed gradient (what backward adds to ``.grad`` on top of the earlier batches'
sum) against its own exact gradient. Compression's errors on the ``k`` batches are
independent and alike, so the step's error is about one batch's over √k (its variance is
one batch's over k, the batches' mean taking 1/k of each): the policy is handed
``step_sum + √k·(ĝ_last − g_last)``, both at the step's scale 1/k, whose distance from
the step's exact gradient ``step_sum`` is that. The probes read their passes on the last
batch the same way (the noise estimate takes one batch of the step's k the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lightning_acgc.kernels.common.sums import dense

__all__ = ["LastBatch", "held_gradients"]


def held_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of what ``.grad`` holds now, by parameter name (zeros where it holds
    nothing; dense), for the parameters that require a gradient.

    Example:
        >>> model = nn.Linear(2, 1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> {n: g.tolist() for n, g in held_gradients(model).items()}
        {'weight': [[1.0, 1.0]], 'bias': [1.0]}
    """
    return {
        n: dense(p.grad.detach()).clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
        if p.requires_grad
    }


@dataclass
class LastBatch:
    """The last batch of a step of ``batches`` accumulated ones (see the module).

    Example:
        >>> last = LastBatch({"w": torch.zeros(2)}, {"w": torch.ones(2)}, batches=4, scale=0.25)
        >>> last.as_step({"w": torch.tensor([2.0, 1.0])})["w"].tolist()  # √4 · (1, 0)
        [2.0, 0.0]
        >>> last.before = {"w": torch.tensor([1.0, 0.0])}  # the earlier batches' sum
        >>> model = nn.Module(); model.w = nn.Parameter(torch.zeros(2))
        >>> model.w.grad = torch.tensor([3.0, 1.0])  # the step's: before + this batch's
        >>> last.compressed_as_step(model)["w"].tolist()
        [2.0, 0.0]
    """

    step_sum: dict[str, torch.Tensor]  # the step's exact gradient, as handed to the policy
    own: dict[str, torch.Tensor]  # the last batch's exact gradient (at the step's scale)
    # (own and before may wait in host memory: each is moved to its gradient's device)
    batches: int
    scale: float = 1.0  # the step's scale of one batch's loss (1/k)
    before: dict[str, torch.Tensor] | None = None  # .grad before the last batch's backward

    def _as_step(self, name: str, got: torch.Tensor) -> torch.Tensor:
        """One parameter's gradient of the last batch alone (at the step's scale) as the
        step's: ``step_sum + √k·(got − own)``, on ``step_sum``'s device and dtype."""
        ref = self.step_sum[name]
        diff = got.to(ref.device, ref.dtype) - self.own[name].to(ref.device, ref.dtype)
        return ref + math.sqrt(self.batches) * diff

    def as_step(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A gradient of the last batch alone (at the step's scale) as the step's: its
        distance from the batch's exact gradient times √k, about ``step_sum``."""
        return {n: self._as_step(n, g) for n, g in grads.items() if n in self.own}

    def compressed_as_step(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The last batch's compressed gradient (``.grad`` now, less :attr:`before`) as
        the step's (:meth:`as_step`), one parameter at a time."""
        before = self.before or {}
        out: dict[str, torch.Tensor] = {}
        for n, p in model.named_parameters():
            if n in self.own:
                got = dense(p.grad.detach()) if p.grad is not None else torch.zeros_like(p)
                out[n] = self._as_step(n, got - before[n].to(got.device) if n in before else got)
        return out
