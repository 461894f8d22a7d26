"""Per-module gradient statistics read during a calibration step's backward.

Forward hooks put a tensor hook on each module output; the tensor hook adds the squared
norm of the output gradient (δ) to the module's total. The hooks exist only while a
calibration step runs (:meth:`GradientStats.start` / :meth:`stop`), so other steps pay
nothing. Outputs made inside a ``torch.func`` transform (a loss term built with
``jacrev``) are skipped: their gradients are the transform's, not the loss's.

Where the step has exact passes (:meth:`GradientStats.exact_pass`, the calibration
cycle's uncompressed passes of the step's batches), only those are read: not the batch
halves of a noise-relative budget, nor the compressed passes of batches accumulated
before the last (summed in, they raised every module's total 1.5x at two batches, 5x
with the halves). Without any, every pass is read (the compressed pass of a step that
calibrates on it alone).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_acgc.policies.base import Reduce
from lightning_acgc.policies.batch_norm_path import BatchNormPaths, Tables, reduced

__all__ = ["GradientStats", "weight_fan_in"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Other libraries' dense layers by class name: the dimension of their 2-D weight that is
# the fan-in (PyTorch Geometric's Linear: (out, in); Hugging Face's Conv1D: (in, out))
_DENSE_IN_DIM = {"Linear": 1, "Conv1D": 0}
# True for a tensor made inside a torch.func transform (vmap, grad, jacrev): its gradient
# is the transform's own, and reading it (float()) raises there.
_in_transform = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)


def weight_fan_in(module: nn.Module) -> int | None:
    """Fan-in of an op that computes a weight gradient from its saved input
    (``in_features`` for Linear, ``C_in/groups * prod(kernel)`` for conv); ``None`` else.

    Other libraries' dense layers named ``Linear`` with a 2-D (out, in) ``weight``
    (PyTorch Geometric's, inside GCNConv, SAGEConv, ...) count as Linear: without them
    a GNN's weight ops were modelled only by the heuristic other-ops factor. So does
    Hugging Face's ``Conv1D`` (GPT-2's dense layer: ``addmm`` with an (in, out) weight),
    without which a GPT-2's attention output was kept whole and its widths ran to 7 bits.

    Example:
        >>> weight_fan_in(nn.Conv2d(16, 32, 3)), weight_fan_in(nn.ReLU())
        (144, None)
    """
    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, _CONV):
        return module.in_channels // module.groups * math.prod(module.kernel_size)
    weight = getattr(module, "weight", None)
    if (
        type(module).__name__ in _DENSE_IN_DIM
        and isinstance(weight, nn.Parameter)
        and not isinstance(weight, nn.parameter.UninitializedParameter)
        and weight.dim() == 2
    ):
        return int(weight.shape[_DENSE_IN_DIM[type(module).__name__]])
    return None


class GradientStats:
    """Sums of squared output-gradient norms per module name, gathered on demand."""

    def __init__(self) -> None:
        self.fan_in: dict[str, int] = {}
        self.grad_sq: dict[str, float] = {}
        self._modules: list[tuple[str, nn.Module]] = []
        self._handles: list[RemovableHandle] = []
        # per output tensor of a forward: [module name, ‖δ‖² of its last backward or None]
        self._pending: list[list] = []
        self._exact_pending: list[list] = []  # of the exact passes
        self._in_exact = False
        self._unscale = 1.0  # 1 / the exact passes' loss scale
        self.loss_scale = 1.0  # of the other passes (the step's own), read without it
        # set by a policy that models BatchNorm inputs' δ path (acgc): read alongside
        self.batch_norm: BatchNormPaths | None = None

    def setup(self, model: nn.Module) -> None:
        self._modules = list(model.named_modules())
        self.fan_in = {name: f for name, m in self._modules if (f := weight_fan_in(m)) is not None}
        if self.batch_norm is not None:
            self.batch_norm.setup(model, self.fan_in)

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def start(self) -> None:
        """Begin gathering (clears the previous totals)."""
        self.grad_sq = {}
        self.loss_scale = 1.0
        self._pending, self._exact_pending = [], []
        if self.batch_norm is not None:
            self.batch_norm.start()
        if not self._handles:
            for name, module in self._modules:
                self._handles.append(module.register_forward_hook(self._on_output(name)))

    def stop(self) -> dict[str, float]:
        """Stop gathering; return squared output-gradient norms by module name."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.batch_norm is not None:
            self.batch_norm.stop()
        # the exact passes were unscaled as recorded; the step's own pass (read where no
        # exact pass ran) is unscaled here, its loss scale known only after its backward
        unscale_sq = 1.0 if self._exact_pending else self.loss_scale**-2
        for name, sq in self._exact_pending or self._pending:
            if sq is not None:
                self.grad_sq[name] = self.grad_sq.get(name, 0.0) + float(sq) * unscale_sq
        self._pending, self._exact_pending = [], []
        return dict(self.grad_sq)

    @contextlib.contextmanager
    def exact_pass(self, loss_scale: float = 1.0) -> Iterator[None]:
        """Inside: an exact pass of the step's batch, the only passes read where any ran;
        its loss scaled by ``loss_scale`` (fp16's GradScaler), which its output gradients
        are read without.

        Example:
            >>> model = nn.Linear(2, 2)
            >>> stats = GradientStats(); stats.setup(model); stats.start()
            >>> with stats.exact_pass():  # δ = (1, 1): ‖δ‖² = 2
            ...     model(torch.ones(1, 2)).sum().backward()
            >>> (2 * model(torch.ones(1, 2))).sum().backward()  # another pass: not read
            >>> stats.stop()
            {'': 2.0}
            >>> stats.start()
            >>> with stats.exact_pass(loss_scale=1024.0):  # read as the unscaled loss's
            ...     (1024.0 * model(torch.ones(1, 2))).sum().backward()
            >>> stats.stop()
            {'': 2.0}
            >>> stats.start()  # no exact pass: the step's own, at its loss scale
            >>> (1024.0 * model(torch.ones(1, 2))).sum().backward()
            >>> stats.loss_scale = 1024.0
            >>> stats.stop()
            {'': 2.0}
        """
        self._in_exact, self._unscale = True, 1.0 / loss_scale
        if self.batch_norm is not None:
            self.batch_norm.unscale = self._unscale
        try:
            yield
        finally:
            self._in_exact, self._unscale = False, 1.0
            if self.batch_norm is not None:
                self.batch_norm.unscale = 1.0

    def batch_norm_tables(
        self, grads: dict[str, torch.Tensor] | None, reduce: Reduce | None
    ) -> Tables:
        """:meth:`BatchNormPaths.tables` of the last calibration, averaged over ranks
        (empty without ``batch_norm``)."""
        if self.batch_norm is None:
            return {}
        return reduced(self.batch_norm.tables(grads or {}), reduce)

    def _on_output(self, name: str):
        def hook(module: nn.Module, args: object, output: object) -> None:
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for out in outs:
                if (
                    isinstance(out, torch.Tensor)
                    and out.requires_grad
                    and out.is_floating_point()
                    and not _in_transform(out)
                ):
                    out.register_hook(self._on_grad(name))

        return hook

    def _on_grad(self, name: str):
        # (a pass's list and loss scale, as they are at its forward)
        pending, unscale = (
            (self._exact_pending, self._unscale) if self._in_exact else (self._pending, 1.0)
        )
        # One entry per output, its last backward's: a loss with a gradient in it (a
        # gradient penalty's autograd.grad(..., create_graph=True) inside the step) runs
        # a backward of its own through the outputs first, of another loss (out.sum():
        # δ with no 1/batch), which summed in put every tensor at 16 bits
        entry = [name, None]
        pending.append(entry)

        def hook(grad: torch.Tensor) -> None:
            # Kept as a 0-d tensor: no device sync inside backward.
            g = grad.detach().float()
            entry[1] = (g if unscale == 1.0 else g * unscale).square().sum()

        return hook
