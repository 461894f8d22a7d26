"""What the derivations of :mod:`lightning_acgc.engine.derive` share: where a saved
tensor came from in the autograd graph (:class:`Origin`), what remakes a saved output
(:class:`Derivation`), and the graph look-ups."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from lightning_acgc.engine.param_casts import cast_source

# the perturbation a gain is measured with (perturbation_gains), relative to the root's
# root mean square (to 1 for a root of zeros)
PROBE_SCALE = 1e-3

__all__ = [
    "Derivation",
    "Origin",
    "affine_param",
    "check_unchanged",
    "dense_order",
    "find",
    "mean_square",
    "perturbation_gains",
    "placed",
    "used_param",
]


class Origin(NamedTuple):
    """Where a saved tensor came from, without holding it: the autograd node that made it
    and its output slot (or, for a leaf, the leaf itself), its shape, dtype and device."""

    node: object | None
    slot: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    leaf: torch.Tensor | None

    @classmethod
    def of(cls, t: torch.Tensor) -> Origin:
        node = t.grad_fn
        leaf = t if node is None and t.requires_grad else None
        return cls(node, t.output_nr if node is not None else 0, t.shape, t.dtype, t.device, leaf)

    def made(self, edge: tuple[object, int]) -> bool:
        """Whether the graph ``edge`` leads to this tensor (its node and output slot, or
        the leaf it accumulates into)."""
        node, slot = edge
        if node is None:
            return False
        if self.node is not None:
            return node is self.node and slot == self.slot
        return self.leaf is not None and getattr(node, "variable", None) is self.leaf

    def like(self, t: torch.Tensor) -> bool:
        return self.shape == t.shape and self.dtype == t.dtype and self.device == t.device


class Derivation(NamedTuple):
    """``fn(*values of recent[i] for i in sources)`` is the saved tensor (its sizes,
    strides and offset); ``name`` says what remakes it.

    ``gain(*the same values)`` is the mean factor from a source's rounding variance to
    the result's: one float for the first source, or a tuple with one per ``roots`` (the
    positions in ``sources`` whose rounding reaches the result: a residual sum has two).
    A value the engine does not hold at hand (a packed tensor saved long before) is
    passed as None: a gain reads only what it needs. Where ``kept`` is a tensor (a ReLU's
    mask, already packed at 1 bit a value: :func:`~lightning_acgc.kernels.mask.mask_pack`'s
    layout), the engine stores it and passes it to ``fn`` and ``gain`` after the sources'
    values. The sources at positions ``stored`` must be
    stored, not remade themselves (no chains of residual sums). A product (a Linear's
    or a convolution's output: the op run again; ``multiplies``, its multiplies per value,
    is its fan-in, 0 for what is not a product) is made only from sources stored or
    remade from stored ones, so that no unpack runs a chain of products back to the
    network's first stored tensor (and holds every tensor on the way at once); which
    products are remade where one blocks another: :mod:`~.product_choice`. ``claim``,
    where given, is called once the engine takes the plan (a product shared by the
    tensors remade from it counts the unpacks to wait for). ``max_depth``, where given,
    bounds how many remakings deep each source may be (0: stored)."""

    fn: Callable[..., torch.Tensor]
    sources: tuple[int, ...]
    name: str
    gain: Callable[..., float | tuple[float, ...]]
    kept: torch.Tensor | None = None
    roots: tuple[int, ...] = (0,)
    stored: tuple[int, ...] = ()
    multiplies: int = 0
    claim: Callable[[], None] | None = None
    max_depth: int | None = None


def placed(saved: torch.Tensor, base: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The view ``saved`` of ``base`` (contiguous, or dense in another order of its
    dimensions: :func:`dense_order`), taken of a tensor of ``base``'s values laid out as
    ``base`` is (which may itself start into its storage: a replayed copy of a
    contiguous slice, ``y[2:4].clone()``, replays as the slice).

    Example:
        >>> y = torch.arange(12.0).view(3, 4)
        >>> base = y[1:].clone()
        >>> placed(base[:, 1], base)(y[1:])
        tensor([5., 9.])
        >>> t = torch.arange(6.0).view(3, 2).t()  # dense, dimensions swapped
        >>> placed(t.t().reshape(6), t)(t.contiguous())
        tensor([0., 1., 2., 3., 4., 5.])
    """
    size, stride = tuple(saved.shape), saved.stride()
    offset = saved.storage_offset() - base.storage_offset()
    order = None if base.is_contiguous() else dense_order(base)

    def place(out: torch.Tensor) -> torch.Tensor:
        out = out.contiguous() if order is None else out.permute(order).contiguous()
        return out.as_strided(size, stride, out.storage_offset() + offset)

    return place


def dense_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The order of ``t``'s dimensions in which it is contiguous (outermost first), where
    it covers its storage span densely in some order (an attention's output laid out
    (batch, seq, heads, dim) but indexed (batch, heads, seq, dim)); None where none.

    Example:
        >>> dense_order(torch.empty(2, 5, 3, 4).transpose(1, 2))
        (0, 2, 1, 3)
        >>> dense_order(torch.empty(4, 4)[:, :2]) is None
        True
    """
    order = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return order if t.permute(order).is_contiguous() else None


def mean_square(t: torch.Tensor | None) -> float:
    """mean(t²) over the finite values of an evenly spaced sample of at most 65536 of
    ``t``'s (a gain's factor); 1.0 where ``t`` is not at hand or none is finite.

    Example:
        >>> mean_square(torch.tensor([1.0, 3.0, float("nan")])), mean_square(None)
        (5.0, 1.0)
    """
    if t is None:
        return 1.0
    with torch.no_grad():
        flat = t.detach().reshape(-1)
        values = flat[:: max(1, flat.numel() // 65536)].double()
        values = values[torch.isfinite(values)]
        return float(values.square().mean()) if values.numel() else 1.0


def find(recent: list[Origin], edge: tuple[object, int], base: torch.Tensor) -> int | None:
    for i in range(len(recent) - 1, -1, -1):
        if recent[i].like(base) and recent[i].made(edge):
            return i
    return None


def affine_param(edge: tuple[object, int]) -> torch.Tensor | bool | None:
    """The parameter a LayerNorm's weight or bias edge accumulates into; None where it has
    none; False where it is computed (not a leaf: not remade)."""
    node = edge[0]
    if node is None:
        return None
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else False


def used_param(edge: tuple[object, int]) -> torch.Tensor | bool | None:
    """:func:`affine_param`, also through a cast: the parameter behind autocast's copy of
    it in another dtype (``ToCopyBackward0`` of a leaf). A remaking casts it again, as
    autocast did (``param.to(dtype)``: the same rounding), so that a bf16-mixed
    convolution's or Linear's output is remade as under float32.

    Example:
        >>> w = torch.nn.Parameter(torch.randn(3, 3))
        >>> used_param((w.to(torch.bfloat16).grad_fn, 0)) is w
        True
    """
    if type(edge[0]).__name__ == "ToCopyBackward0":
        param = cast_source(edge[0])
        return param if param is not None else False
    return affine_param(edge)


def check_unchanged(what: str, *params: torch.Tensor | None) -> Callable[[], None]:
    """A check, run at unpack, that ``params`` (an op's weight and bias, read again to
    remake its output; a parameter cast again for autocast) were not modified in place
    since forward; raises naming ``what`` (what they are). Autograd checks the tensors it
    saved, not a bias that only the remaking reads."""
    versions = tuple(-1 if p is None else p._version for p in params)

    def check() -> None:
        if tuple(-1 if p is None else p._version for p in params) != versions:
            raise RuntimeError(
                f"lightning_acgc: {what} was modified in place between forward and "
                "backward: what is remade from it at unpack would not be the forward's"
            )

    return check


def perturbation_gains(
    fn: Callable[..., torch.Tensor], values: tuple[torch.Tensor, ...], roots: tuple[int, ...]
) -> tuple[float, ...]:
    """Per root (a position in ``values``): the mean square change of ``fn(*values)`` over
    the variance of a small Gaussian added to that root, in float32, from one fixed seed
    (the gain of a remaking with several roots: an attention's, a softmax's).

    Example:
        >>> x, y = torch.randn(64, 64), torch.randn(64, 64)
        >>> g = perturbation_gains(lambda a, b: 3 * a + b, (x, y), (0, 1))
        >>> [round(v) for v in g]  # (one draw of 4096 values)
        [9, 1]
    """
    with torch.no_grad():
        # (a mask, bool or packed bits, passed as it is)
        wide = [v.detach().float() if v.is_floating_point() else v for v in values]
        exact = fn(*wide)
        generator = torch.Generator(device=exact.device).manual_seed(0)
        out = []
        for r in roots:
            x = wide[r]
            rms = mean_square(x) ** 0.5
            sigma = PROBE_SCALE * (rms if rms > 0 else 1.0)  # (a root of zeros: absolute)
            noise = torch.randn(x.shape, generator=generator, device=x.device) * sigma
            moved = fn(*wide[:r], x + noise, *wide[r + 1 :])
            change = (moved - exact).double().square().reshape(-1)
            change = change[torch.isfinite(change)]  # (a row masked whole: NaN)
            out.append(float(change.mean()) / sigma**2 if change.numel() else 1.0)
    return tuple(out)
