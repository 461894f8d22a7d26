"""Which products (Linear and convolution outputs) are remade, when one blocks another.

A product is remade only from a tensor stored or remade from stored ones
(:class:`~lightning_acgc.engine.derive_graph.Derivation`): remaking one blocks the next
product whose input is made from it. Decided greedily in forward order, a ResNet-50
bottleneck remakes its 3x3 convolution's output in every other block, which blocks the
1x1 convolution after it: four times the values for a ninth of the multiplies each.

So a product that blocks a later one *yields* where the later one dominates it: at least
as many values saved and at most as many multiplies per value (its fan-in), one of them
strictly. From the next step on the yielding product is stored, the later one remade.
A product yields once and stays stored until the engine is removed (each step's choice
is then the same; nothing oscillates). Equal products (ResNet-18's 3x3 convolutions, each
blocking the next) keep the forward order.

Example:
    >>> choice = ProductChoice()
    >>> choice.made("bn2:0", values=64, multiplies=576)  # a 3x3 conv of 64 channels
    >>> choice.blocked(values=256, multiplies=64, by=["bn2:0"])  # the 1x1 conv after it
    >>> choice.allowed("bn2:0")
    False
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ProductChoice"]


class ProductChoice:
    """The products remade this fit (values and multiplies per value, by site) and those
    that yield to a later one."""

    def __init__(self) -> None:
        self._made: dict[str, tuple[int, int]] = {}
        self._yielding: set[str] = set()

    def allowed(self, key: str) -> bool:
        """Whether the product saved by site ``key`` may be remade."""
        return key not in self._yielding

    def made(self, key: str, values: int, multiplies: int) -> None:
        """Note that site ``key``'s product (``values`` values, ``multiplies`` multiplies
        each) is remade."""
        self._made[key] = (values, multiplies)

    def blocked(self, values: int, multiplies: int, by: Iterable[str]) -> None:
        """A product of ``values`` values at ``multiplies`` each was blocked by the
        products remade at sites ``by``: those it dominates yield from now on. Where
        any blocker is not a product noted here, or does not yield, nothing changes (the
        blocked product would stay blocked)."""
        blockers = list(by)
        if not blockers or any(k not in self._made for k in blockers):
            return
        if all(_dominates((values, multiplies), self._made[k]) for k in blockers):
            self._yielding.update(blockers)

    def forget(self) -> None:
        """Drop every choice (the engine is removed; the next fit chooses again)."""
        self._made.clear()
        self._yielding.clear()


def _dominates(later: tuple[int, int], earlier: tuple[int, int]) -> bool:
    (values, mult), (values0, mult0) = later, earlier
    return values >= values0 and mult <= mult0 and (values > values0 or mult < mult0)
