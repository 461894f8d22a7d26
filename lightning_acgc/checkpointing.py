"""``CheckpointedModules``: chosen submodules of a model run under
``torch.utils.checkpoint`` (non-reentrant) while installed, and as before once removed.

Checkpointing a block keeps only its input for backward and runs the block again there;
activation compression then compresses what autograd still saves: each block's input
and the tensors saved outside the blocks (the engine marks the inputs,
``SiteInfo.checkpoint_input``; ``acgc`` keeps them at 8 bits or more where the block is
smooth, float16 or more where it holds a ReLU-like op). The
callback's ``checkpoint_modules`` installs one of these on fit start and removes it on
fit end, also after an exception.

Patterns name modules by class (``"BertLayer"``: every module of that class) or by
qualified name, with ``fnmatch`` wildcards (``"encoder.layer.*"``). Where a module and
one inside it both match, only the outer one is checkpointed; the model itself never is.
Under ``torch.no_grad`` (validation, prediction) the blocks run as they are.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointedModules", "check_patterns"]

_ABSENT = object()


def check_patterns(patterns: str | Sequence[str] | None) -> tuple[str, ...]:
    """The patterns as a tuple (``None``: none), or a ``ValueError`` naming the argument.

    Example:
        >>> check_patterns("BertLayer"), check_patterns(None)
        (('BertLayer',), ())
        >>> check_patterns([""])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: checkpoint_modules=[''] must be a module class name or a qualified ...
    """
    if patterns is None:
        return ()
    items = (patterns,) if isinstance(patterns, str) else patterns
    try:
        items = tuple(items)
    except TypeError:
        items = (None,)
    if not items or not all(isinstance(p, str) and p.strip() for p in items):
        raise ValueError(
            f"checkpoint_modules={patterns!r} must be a module class name or a qualified "
            "module name (fnmatch wildcards allowed), or a list of them"
        )
    return items


def _run_checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward`` under non-reentrant checkpointing when autograd records, else as is.

    Tensor keyword arguments go to ``checkpoint`` as positional ones, so that it saves
    them through the hooks in force (counted and compressed like the positional inputs;
    a closure would keep them alive unseen), and no keyword can clash with
    ``checkpoint``'s own."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    rest = {k: v for k, v in kwargs.items() if k not in names}
    n = len(args)

    def call(*inputs: Any) -> Any:
        return forward(*inputs[:n], **rest, **dict(zip(names, inputs[n:], strict=True)))

    return checkpoint(call, *args, *(kwargs[k] for k in names), use_reentrant=False)


class CheckpointedModules:
    """Runs the submodules that ``patterns`` name under ``torch.utils.checkpoint``.

    Args:
        patterns: module class names or qualified names (``fnmatch`` wildcards).

    Raises:
        ValueError: an empty or non-text pattern (here); :meth:`install` raises when no
            module of the model matches.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 2)))
        >>> blocks = CheckpointedModules("1")
        >>> blocks.install(model)
        ['1']
        >>> model(torch.randn(3, 4, requires_grad=True)).sum().backward()
        >>> blocks.remove()
        >>> "forward" in vars(model[1])
        False
    """

    def __init__(self, patterns: str | Sequence[str]) -> None:
        self.patterns = check_patterns(patterns)
        if not self.patterns:
            raise ValueError("checkpoint_modules=[] names no module")
        self._installed: list[tuple[nn.Module, Any, Callable[..., Any]]] = []
        self.names: list[str] = []

    @property
    def installed(self) -> bool:
        return bool(self._installed)

    def matches(self, model: nn.Module) -> list[str]:
        """Qualified names of the modules checkpointed: matches not inside another one."""
        found: list[str] = []
        for name, module in model.named_modules():
            if not name or any(name.startswith(f"{outer}.") for outer in found):
                continue
            if any(
                p == type(module).__name__ or fnmatch.fnmatchcase(name, p) for p in self.patterns
            ):
                found.append(name)
        return found

    def install(self, model: nn.Module) -> list[str]:
        """Wrap each matching module's ``forward``; the names wrapped."""
        self.remove()
        names = self.matches(model)
        if not names:
            classes = sorted({type(m).__name__ for n, m in model.named_modules() if n})
            raise ValueError(
                f"checkpoint_modules={list(self.patterns)!r} matches no module of "
                f"{type(model).__name__}; its module classes: {', '.join(classes[:20])}"
                + (", ..." if len(classes) > 20 else "")
            )
        for name in names:
            module = model.get_submodule(name)
            before = vars(module).get("forward", _ABSENT)
            wrapper = functools.partial(_run_checkpointed, module.forward)
            module.forward = wrapper
            self._installed.append((module, before, wrapper))
        self.names = names
        return names

    def remove(self) -> None:
        """Put every wrapped ``forward`` back (idempotent)."""
        for module, before, wrapper in reversed(self._installed):
            if vars(module).get("forward") is not wrapper:
                continue  # replaced by someone else since: theirs stays
            if before is _ABSENT:
                del module.forward
            else:
                module.forward = before
        self._installed = []
        self.names = []
