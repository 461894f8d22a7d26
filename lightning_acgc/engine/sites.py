"""Which module saved a tensor: a stack of module names kept by forward hooks."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_acgc.engine.param_casts import FrozenParameters
from lightning_acgc.engine.param_weights import ComputedWeights
from lightning_acgc.engine.replay import ModuleReplays

__all__ = [
    "NORM_TYPES",
    "ModuleTracker",
    "SiteInfo",
    "is_norm_statistic",
    "is_norm_type",
    "is_row_norm",
    "is_row_statistic",
    "saved_by_checkpoint",
]

NORM_TYPES = frozenset(
    {
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "SyncBatchNorm",
        "LayerNorm",
        "GroupNorm",
        "InstanceNorm1d",
        "InstanceNorm2d",
        "InstanceNorm3d",
        "RMSNorm",
    }
)
# Other libraries' row norms by their class name: Hugging Face's LlamaRMSNorm,
# T5LayerNorm (elementwise ops, as nn.RMSNorm in Python), timm's LayerNorm2d, apex's
# FusedLayerNorm, ...
ROW_NORM_MARKERS = ("RMSNorm", "LayerNorm")


def is_norm_type(module_type: str) -> bool:
    """Whether a module of class ``module_type`` normalizes its input: one of
    ``NORM_TYPES`` or a row norm named like one (another library's).

    Example:
        >>> is_norm_type("LayerNorm"), is_norm_type("LlamaRMSNorm"), is_norm_type("Linear")
        (True, True, False)
    """
    return module_type in NORM_TYPES or is_row_norm(module_type)


def is_row_norm(module_type: str) -> bool:
    """Whether a module of class ``module_type`` normalizes each row of its input's last
    dimension (LayerNorm, RMSNorm, and classes named with either).

    Example:
        >>> is_row_norm("LayerNorm2d"), is_row_norm("MixedFusedRMSNorm"), is_row_norm("GroupNorm")
        (True, True, False)
    """
    return any(marker in module_type for marker in ROW_NORM_MARKERS)


@dataclass(frozen=True)
class SiteInfo:
    """Where a saved tensor comes from: the innermost running module and the ordinal
    of this tensor among those that module saved in the current step.

    ``checkpoint_input``: saved by ``torch.utils.checkpoint`` as the input of a
    checkpointed region (:func:`saved_by_checkpoint`). Backward runs the region's
    forward again from its decoded value, so its error reaches every layer of the region,
    through ReLU masks and normalization statistics remade from it, not only one op's
    gradient."""

    module: str
    module_type: str
    ordinal: int
    checkpoint_input: bool = False

    @property
    def key(self) -> str:
        return f"{self.module}:{self.ordinal}"

    @property
    def outside_every_module(self) -> bool:
        """Saved while no module's forward ran: the loss and other ops of a training step
        around the model (inside the root model's forward the site has the root's name ""
        but its type).

        Example:
            >>> loss, root = SiteInfo("", "", 0), SiteInfo("", "Net", 0)
            >>> loss.outside_every_module, root.outside_every_module
            (True, False)
        """
        return not self.module and not self.module_type


class ModuleTracker:
    """Tracks the innermost running module of ``model`` (or, with ``model=None``, of any
    module run by this thread) while installed.

    Hooks are registered on :meth:`install` and removed on :meth:`remove`; nothing
    else is touched.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._model = model
        self._handles: list[RemovableHandle] = []
        self._stack: list[tuple[str, str]] = []
        self._ordinals: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._thread = threading.get_ident()
        self.frozen = FrozenParameters(model)  # their copies are cast again (param_casts.py)
        self.weights = ComputedWeights(model)  # kept as they are (param_weights.py)
        self.replays = ModuleReplays()  # elementwise modules' saves, remade (replay.py)

    # -- installation -------------------------------------------------------
    def install(self) -> None:
        if self._handles:
            return
        self._thread = threading.get_ident()
        self.weights.install()
        if self._model is not None:
            for name, module in self._model.named_modules():
                self._names[id(module)] = name
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        else:
            from torch.nn.modules.module import (
                register_module_forward_hook,
                register_module_forward_pre_hook,
            )

            self._handles.append(register_module_forward_pre_hook(self._enter))
            self._handles.append(register_module_forward_hook(self._exit, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        self.weights.remove()
        self.replays.forget()

    # -- hooks --------------------------------------------------------------
    def _name_of(self, module: nn.Module) -> str:
        name = self._names.get(id(module))
        if name is None:  # global mode: name by type and order of first appearance
            name = f"{type(module).__name__}#{len(self._names)}"
            self._names[id(module)] = name
        return name

    # Inside a region that ``torch.compile`` traces, the hooks do nothing: Dynamo would
    # otherwise trace ``threading.get_ident`` (a graph break and a warning), and the
    # compiled graph saves its tensors at its end anyway, all under the enclosing module.
    def _enter(self, module: nn.Module, args: object) -> None:
        if torch.compiler.is_compiling():
            return
        if threading.get_ident() == self._thread:
            name = self._name_of(module)
            self._stack.append((name, type(module).__name__))
            self.replays.enter(module, name, args, self._ordinals.get(name, 0))

    def _exit(self, module: nn.Module, args: object, output: object) -> None:
        if torch.compiler.is_compiling():
            return
        if threading.get_ident() == self._thread and self._stack:
            self._stack.pop()
            self.replays.exit(module, output)

    # -- sites --------------------------------------------------------------
    def new_step(self) -> None:
        """Restart the per-module ordinals (sites are numbered per step)."""
        self._ordinals.clear()
        self._stack.clear()
        self.replays.new_step()
        self.frozen.refresh()
        self.weights.new_step()

    def next_site(self, checkpoint_input: bool = False) -> SiteInfo:
        module, module_type = self._stack[-1] if self._stack else ("", "")
        ordinal = self._ordinals.get(module, 0)
        self._ordinals[module] = ordinal + 1
        return SiteInfo(module, module_type, ordinal, checkpoint_input)

    def resident_storages(self) -> set[int]:
        """Storage pointers of the model's parameters and buffers (kept anyway)."""
        if self._model is None:
            return set()
        tensors = [*self._model.parameters(), *self._model.buffers()]
        return {t.untyped_storage().data_ptr() for t in tensors if t.device.type != "meta"}


CHECKPOINT_SOURCE = os.path.join("torch", "utils", "checkpoint.py")


def saved_by_checkpoint(frame: FrameType | None) -> bool:
    """Whether the Python frame that made autograd save a tensor (``sys._getframe(1)`` in
    a pack hook) is ``torch.utils.checkpoint`` keeping a checkpointed region's input.

    Checkpointing saves the region's inputs through the saved-tensor hooks in force:
    non-reentrant from ``_CheckpointFrame.save_inputs`` (through ``Function.apply`` of its
    ``_NoopSaveInputs`` in older torch), reentrant from its Function's
    ``save_for_backward``. What the region saves inside goes to the checkpoint's own
    hooks (non-reentrant) or nowhere (reentrant runs it without grad): nothing else
    reaches a pack hook from that file.

    Example:
        >>> import sys
        >>> from torch.utils.checkpoint import checkpoint
        >>> seen = []
        >>> def pack(t):
        ...     seen.append(saved_by_checkpoint(sys._getframe(1)))
        ...     return t
        >>> x = torch.ones(3, requires_grad=True)
        >>> with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ...     y = checkpoint(torch.sin, x * 2, use_reentrant=False).exp()
        >>> seen
        [True, False]
    """
    for _ in range(2):  # the saving frame, or Function.apply's caller
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(CHECKPOINT_SOURCE):
            return True
        frame = frame.f_back
    return False


def is_leaf_parameter(t: torch.Tensor) -> bool:
    """A leaf that requires grad (a parameter), or a view of one."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def is_norm_statistic(module_type: str, x: torch.Tensor) -> bool:
    """Whether ``x``, saved inside a normalization module, is one of its per-row or
    per-channel statistics (LayerNorm's and RMSNorm's mean and 1/σ of shape (..., 1),
    BatchNorm's per-channel mean and 1/σ, GroupNorm's per sample and group, (N, G): a
    GroupNorm's input is (N, C, ...), and one of shape (N, C) is kept as well, which
    loses nothing): a 1/C share of the input's bytes, and read
    in products with itself by the backward (x̂ = (x − μ)·r, then terms in r and r³), so
    its rounding errors do not cancel: at 1 bit they left a char-level transformer at
    +10% validation loss (acgc, e = 0.3), and at 2 bits (BatchNorm's, packed with other
    small tensors) a fixed 2-bit ResNet fit at NaN. The engine keeps them as they are,
    whatever the policy (reason "norm statistic" in the per-site table).

    Example:
        >>> is_norm_statistic("LayerNorm", torch.zeros(8, 16, 1))
        True
        >>> is_norm_statistic("LayerNorm", torch.zeros(8, 16, 64))
        False
        >>> is_norm_statistic("GroupNorm", torch.zeros(64, 32))
        True
    """
    if not is_norm_type(module_type) or not x.is_floating_point():
        return False
    return x.dim() <= 1 or x.shape[-1] == 1 or (module_type == "GroupNorm" and x.dim() == 2)


def is_row_statistic(x: torch.Tensor, recent: Iterable[torch.Tensor | None]) -> bool:
    """Whether ``x`` is a per-row statistic an op saves beside its input (without history,
    floating, the shape of one of ``recent``, the tensors saved just before it, less its
    last dimension): a fused attention's log-sum-exp per query row
    (``F.scaled_dot_product_attention``'s flash and efficient kernels). Its backward
    remakes the probabilities as exp(s − lse): an error in it scales a whole row, it
    does not average out. Rounded alone (every other tensor exact), the log-sum-exp of
    one attention (16 x 4 heads x 128 queries, head 32) put the gradient of q, k and v
    0.017 off at 8 bits and 0.30 at 4 where the scores spread as a trained model's
    (queries x 4), 0.075 and 3.3 at x 16. The engine keeps it as it is, whatever the
    policy (reason "row statistic"), as a norm's statistics: 1/head_dim of the query's
    bytes. (The queries and keys enter the same exponential in that backward: with every
    other tensor at 4 bits and the scores at x 64 the gradient went 1e9 off, the
    log-sum-exp kept or not; a fixed setting cannot see that, acgc's calibration
    measures it.)

    Example:
        >>> q = torch.randn(2, 4, 16, 8)
        >>> is_row_statistic(torch.randn(2, 4, 16), [q, q, q])
        True
        >>> is_row_statistic(torch.randn(2, 4, 16, 8), [q]), is_row_statistic(q[..., 0], [None])
        (False, False)
    """
    if x.grad_fn is not None or x.requires_grad or not x.is_floating_point() or x.dim() < 2:
        return False
    shape = tuple(x.shape)
    return any(
        u is not None
        and u.dim() == x.dim() + 1
        and tuple(u.shape[:-1]) == shape
        and u.shape[-1] > 1
        for u in recent
    )
