"""Where a max (or min) reduction's input is rounded, its backward still finds the maxima.

``amax``'s backward routes the gradient to the input elements equal to the result,
``grad · (x == result) / count``. The engine remakes the result at unpack from the
input's decoded values (:mod:`lightning_acgc.engine.exact`), so the count is never 0,
but rounding moves the maxima: at 6 bits the top of a 256-value group holds several
decoded values at the same level, and the gradient of a global max pooling was split
among them (a conv → ReLU → ``amax`` model: 0.14-0.40 relative gradient error at acgc's
e = 0.05 on some calibration steps; fixed 4-bit quant: 0.15-0.30).

So at the result's save the engine keeps which input elements were the extrema (one bit
a value, and the result itself, a value per reduced group) and patches the input's
decoded values: the extrema get their exact value, every other element is held strictly
below it (above it for ``amin``). ``scatter_reduce`` and ``index_reduce`` by ``amax`` or
``amin`` (a GNN's max aggregation) compare both inputs with the result: ``self`` with
it elementwise, ``src`` with the result gathered by ``index`` (read, at unpack, from the
index's holder), so each gets a patch. On exact values the patch changes nothing; on decoded
ones it moves only the elements that rounding put at or past the extremum, by at most
their rounding error. The backward then sees exactly the forward's maxima, ties included.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_acgc.engine.exact import saved_dims
from lightning_acgc.kernels.mask import mask_pack, mask_unpack

__all__ = ["ExtremumPatch", "extremum_patch", "scatter_patches"]

# autograd nodes of max/min reductions (by dims, or over the whole tensor) whose saved
# input and result are compared in backward
_LARGEST = {
    "AmaxBackward0": True,
    "MaxBackward1": True,
    "AminBackward0": False,
    "MinBackward1": False,
}


class ExtremumPatch:
    """The exact extrema of one reduction, applied to decoded values of its input.

    Example:
        >>> x = torch.tensor([[1.0, 3.0, 2.9], [0.5, 0.5, -1.0]], requires_grad=True) * 1
        >>> patch = extremum_patch(x.amax(dim=1), x)
        >>> decoded = torch.tensor([[1.0, 3.0, 3.0], [0.5, 0.4, -1.0]])  # ties, a flip
        >>> patch(decoded).tolist()[0][2] < 3.0, patch(decoded).amax(1).tolist()
        (True, [3.0, 0.5])
    """

    def __init__(
        self,
        bits: torch.Tensor,
        extremum: torch.Tensor,
        largest: bool,
        expand: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.bits = bits  # packed: which input elements equal their group's extremum
        self.extremum = extremum  # the result, broadcastable against the input
        self.largest = largest
        self.expand = expand  # the result to the input's shape (a gather by index)

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed mask and the result."""
        return self.bits.numel() + self.extremum.numel() * self.extremum.element_size()

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (the input's decoded values, its shape) with the extrema exact and
        every other element strictly inside them."""
        at = mask_unpack(self.bits, values.numel()).view(values.shape)
        top = self.extremum if self.expand is None else self.expand(self.extremum)
        top = top.to(values.dtype)
        away = torch.full_like(top, -torch.inf if self.largest else torch.inf)
        inside = torch.nextafter(top, away)
        clamped = torch.minimum(values, inside) if self.largest else torch.maximum(values, inside)
        # a NaN extremum (a NaN in its group: on a device the engine cannot look) leaves
        # its group as decoded
        return torch.where(at, top, torch.where(top.isnan(), values, clamped))


def _keepdim_shape(node: object, source: torch.Tensor) -> list[int] | None:
    """The result's shape with its reduced dims kept (size 1), or None for a whole-tensor
    reduction (a 0-d result broadcasts as it is)."""
    if type(node).__name__ in ("MaxBackward1", "MinBackward1"):
        return None
    ndim = source.dim()
    dims = saved_dims(node._saved_dim) or ()  # type: ignore[attr-defined]
    reduced = {d % max(ndim, 1) for d in dims} or set(range(ndim))
    return [1 if i in reduced else n for i, n in enumerate(source.shape)]


def extremum_patch(result: torch.Tensor, source: torch.Tensor) -> ExtremumPatch | None:
    """For the saved ``result`` of a max/min reduction of ``source`` (``amax``, ``amin``,
    ``max()``, ``min()``; the caller has checked it is that reduction of that input), the
    patch that keeps its extrema through rounding; None for other reductions, for empty
    inputs, and for integer inputs.

    Example:
        >>> x = torch.randn(4, 5, requires_grad=True) * 1
        >>> patch = extremum_patch(x.amax(dim=1, keepdim=True), x)
        >>> torch.equal(patch(x.detach()), x.detach())  # exact values: unchanged
        True
    """
    node = result.grad_fn
    largest = _LARGEST.get(type(node).__name__) if node is not None else None
    if largest is None or source.numel() == 0 or not source.is_floating_point():
        return None
    with torch.no_grad():
        top = result.detach()
        shape = _keepdim_shape(node, source)
        if shape is not None:
            top = top.reshape(shape)
        at = source.detach() == top
        return ExtremumPatch(mask_pack(at.reshape(-1)), top.clone(), largest)


def scatter_patches(
    result: torch.Tensor,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    index_at_unpack: Callable[[], torch.Tensor],
) -> tuple[ExtremumPatch, ExtremumPatch] | None:
    """For the saved ``result`` of ``scatter_reduce``/``index_reduce`` by ``amax`` or
    ``amin`` of ``inputs`` = (index, self, src) (the caller has checked it is that
    reduction of them): the patches of ``self`` and of ``src``; ``src``'s reads the index
    at unpack from ``index_at_unpack`` (what the index's holder unpacks). None for other
    reductions and empty or integer values. The result is held once (by ``self``'s patch:
    the caller charges both patches' masks and it).

    Example:
        >>> src = torch.tensor([[1.0], [3.0], [2.0], [2.0]], requires_grad=True) * 1
        >>> index = torch.tensor([[0], [0], [1], [1]])
        >>> out = torch.zeros(2, 1).scatter_reduce(0, index, src, "amax", include_self=False)
        >>> _, on_src = scatter_patches(out, (index, torch.zeros(2, 1), src), lambda: index)
        >>> fixed = on_src(torch.full((4, 1), 3.0)).flatten()  # a tie, decoded
        >>> bool(fixed[0] < 3.0), fixed[1].item(), bool((fixed[2:] == 2.0).all())
        (True, 3.0, True)
    """
    node = result.grad_fn
    name = type(node).__name__ if node is not None else ""
    if name not in ("ScatterReduceBackward0", "IndexReduceBackward0"):
        return None
    reduce = node._saved_reduce  # type: ignore[union-attr]
    index, values, src = inputs
    if reduce not in ("amax", "amin") or not src.is_floating_point() or src.numel() == 0:
        return None
    dim, largest = int(node._saved_dim), reduce == "amax"  # type: ignore[union-attr]

    def gathered(top: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if name == "IndexReduceBackward0":
            return top.index_select(dim, idx)
        return top.gather(dim, idx)

    with torch.no_grad():
        top = result.detach().clone()
        at_src = src.detach() == gathered(top, index)  # the exact index, at the save
        return (
            ExtremumPatch(mask_pack((values.detach() == top).reshape(-1)), top, largest),
            ExtremumPatch(
                mask_pack(at_src.reshape(-1)),
                top,
                largest,
                lambda t: gathered(t, index_at_unpack()),
            ),
        )
