"""The step's inputs: tensors the caller holds for the whole step (the batch).

Autograd saves the batch as it is where the first layer reads it (a Linear's or a
convolution's input, an embedding's indices): that costs plain training nothing, the
batch being alive anyway until the step ends. A packed copy of it only adds memory (the
GCN recipe's node features at 5 bits: 82 kB more, not 430 kB less). So the engine saves
the step's inputs as they are and counts them neither as saved nor as kept, as it does
parameters and buffers.

Held weakly: a tensor freed before the step ends is no longer held, and a storage that
reuses its address is not taken for it.

Example:
    >>> import torch
    >>> x = torch.randn(4, 3)
    >>> inputs = StepInputs()
    >>> inputs.hold({"x": x, "y": [torch.zeros(4), "label"]})
    >>> inputs.holds(x[:2]), inputs.holds(torch.randn(4, 3))
    (True, False)
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["SIXTEEN_BIT", "StepInputs", "tensors_in"]

MAX_DEPTH = 8  # nesting followed into a batch (a dict of lists of tensors is 2)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def tensors_in(batch: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors nested in ``batch``: in mappings, lists, tuples, dataclasses and
    objects with a ``to_dict`` method (a PyTorch Geometric ``Data``), ``MAX_DEPTH`` deep.

    Example:
        >>> [t.shape[0] for t in tensors_in(([torch.ones(2)], {"a": torch.ones(3)}))]
        [2, 3]
    """
    if isinstance(batch, torch.Tensor):
        yield batch
        return
    if depth >= MAX_DEPTH or isinstance(batch, (str, bytes)):
        return
    if isinstance(batch, Mapping):
        items: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif callable(getattr(batch, "to_dict", None)):
        try:
            items = batch.to_dict().values()
        except Exception:  # a to_dict that wants arguments, or fails: nothing held
            return
    else:
        return
    for item in items:
        yield from tensors_in(item, depth + 1)


class StepInputs:
    """The storages of the tensors handed to :meth:`hold` (weakly), by address."""

    def __init__(self) -> None:
        self._held: dict[int, weakref.ReferenceType] = {}

    def hold(self, batch: Any) -> None:
        """Hold the strided tensors nested in ``batch`` (see :func:`tensors_in`) instead
        of those held before."""
        self._held = {
            t.untyped_storage().data_ptr(): weakref.ref(t)
            for t in tensors_in(batch)
            if t.layout == torch.strided and t.untyped_storage().nbytes()
        }

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in the storage of a held tensor still alive."""
        return self.holds_storage(t.untyped_storage().data_ptr())

    def holds_storage(self, ptr: int) -> bool:
        """Whether the storage at address ``ptr`` is a held tensor's, still alive (the
        engine's pack hook has the address at hand)."""
        ref = self._held.get(ptr)
        return ref is not None and ref() is not None

    def cast_source(self, t: torch.Tensor) -> torch.Tensor | None:
        """The held input of which ``t`` (or the tensor it is a view of) is a 16-bit copy:
        autocast's cast of the batch for a bf16 first layer (a convolution's images, a
        graph network's node features), which plain autograd holds beside the batch. Told
        by value (the input cast to ``t``'s dtype equals it), for a tensor without
        autograd history of a held input's shape; None otherwise.

        Example:
            >>> x = torch.randn(4, 3)
            >>> inputs = StepInputs()
            >>> inputs.hold([x])
            >>> inputs.cast_source(x.to(torch.bfloat16)) is x
            True
            >>> inputs.cast_source(torch.randn(4, 3).to(torch.bfloat16)) is None
            True
        """
        base = t if t._base is None else t._base
        if base.grad_fn is not None or base.requires_grad or base.dtype not in SIXTEEN_BIT:
            return None
        for ref in self._held.values():
            x = ref()
            if (
                x is not None
                and x.shape == base.shape
                and x.device == base.device
                and x.is_floating_point()
                and x.dtype != base.dtype
                and torch.equal(x.to(base.dtype), base)
            ):
                return x
        return None

    def storages(self) -> set[int]:
        """The addresses of the held storages whose tensor is alive."""
        return {ptr for ptr, ref in self._held.items() if ref() is not None}

    def clear(self) -> None:
        self._held = {}
