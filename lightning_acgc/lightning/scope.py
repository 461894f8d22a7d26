"""How ``training_step`` is scoped: the compression strategies' mixin, and for a stock
strategy a patch of that one instance. Both call :meth:`Scope.run` around
``training_step`` (the :class:`~lightning_acgc.lightning.driver.CalibrationDriver`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["CompressionScopeMixin", "Scope", "TrainingStepPatch"]

_MISSING = object()


class Scope(Protocol):
    """Runs one ``training_step`` call as one compressed engine step."""

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


class CompressionScopeMixin:
    """Strategy mixin: ``training_step`` runs inside the attached :class:`Scope`.

    With no scope attached (no :class:`~lightning_acgc.ActivationCompression` active),
    the strategy behaves exactly like its Lightning parent.
    """

    _acgc_scope: Scope | None = None

    def attach_compression(self, scope: Scope) -> None:
        """Scope every later ``training_step`` with ``scope`` (called on fit start)."""
        if self._acgc_scope is not None and self._acgc_scope is not scope:
            raise RuntimeError(
                f"{type(self).__name__} already runs another ActivationCompression; "
                "one compression callback per Trainer"
            )
        self._acgc_scope = scope

    def detach_compression(self) -> None:
        """Stop scoping ``training_step`` (called on fit end and on exceptions)."""
        self._acgc_scope = None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        scope = self._acgc_scope
        if scope is None:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        return scope.run(super().training_step, *args, **kwargs)  # type: ignore[misc]


class TrainingStepPatch:
    """Wraps ``strategy.training_step`` on this one instance (a stock Lightning strategy)
    and undoes exactly that in :meth:`restore`; the class and other instances are untouched.

    Args:
        strategy: the trainer's strategy instance.
        scope: what each call runs inside.
    """

    def __init__(self, strategy: Strategy, scope: Scope) -> None:
        self.strategy = strategy
        self._previous = strategy.__dict__.get("training_step", _MISSING)
        original = strategy.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            return scope.run(original, *args, **kwargs)

        training_step.__wrapped__ = original  # type: ignore[attr-defined]
        self._wrapper = training_step
        strategy.training_step = training_step  # type: ignore[method-assign]

    def restore(self) -> None:
        """Put back what was there before (idempotent)."""
        if self._wrapper is None:
            return
        current = self.strategy.__dict__.get("training_step", _MISSING)
        if current is not self._wrapper:
            rank_zero_warn(
                "lightning_acgc: strategy.training_step was replaced by someone else while "
                "ActivationCompression wrapped it; leaving the current one in place"
            )
        elif self._previous is _MISSING:
            del self.strategy.__dict__["training_step"]
        else:
            self.strategy.__dict__["training_step"] = self._previous
        self._wrapper = None
