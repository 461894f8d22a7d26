"""Saved tensors the engine stores as nothing and remakes at unpack from tensors saved
just before them: reduction results their backward compares with their inputs
(:mod:`lightning_acgc.engine.exact`) and, where the policy asks, activations'
and LayerNorm outputs (:mod:`lightning_acgc.engine.derive`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lightning_acgc.engine import derive, exact
from lightning_acgc.engine.meter import SiteRecord
from lightning_acgc.engine.saved import Saved
from lightning_acgc.engine.sites import SiteInfo

__all__ = ["Recomputing"]


class Recomputing:
    """Mixin of :class:`~lightning_acgc.engine.compressor.ActivationCompressor`; uses its
    ``policy``, ``_recent``, ``_dedup``, ``_keep`` and ``_record``."""

    policy: Any
    _recent: Any
    _dedup: dict[tuple, tuple[Any, weakref.ReferenceType]]

    def _keep(self, *args: Any, **kwargs: Any) -> Saved:
        raise NotImplementedError

    def _record(self, *args: Any) -> SiteRecord:
        raise NotImplementedError

    def _comparing(self, site: SiteInfo, t: torch.Tensor, key: tuple, ref: Any, raw: int) -> Any:
        """A reduction result its backward compares with its inputs (amax, ...; see
        :mod:`lightning_acgc.engine.exact`): recomputed at unpack from what its inputs'
        holders unpack (nothing stored), or kept as it is where they are not found."""
        recent = [(entry[0](), entry[1]) for entry in self._recent]
        plan = exact.recompute_plan(t, [tensor for tensor, _ in recent])
        sources = []
        for tensor, holder in recent[len(recent) - plan[1] :] if plan else ():
            sources.append(tensor if holder is None else holder())
        if plan is None or any(s is None for s in sources):
            return self._keep(site, t, key, ref, raw, "compared by its backward")
        saved = Saved(None, None, site.key, "recomputed", sources=tuple(sources), recompute=plan[0])
        self._dedup[key] = (ref, weakref.ref(saved))
        named = [s.site for s in sources if isinstance(s, Saved)]
        self._record(site, t, "recomputed", f"from {', '.join(named) or 'its inputs'}", raw, 0)
        return saved

    def _derived(self, site: SiteInfo, t: torch.Tensor, key: tuple, ref: Any, raw: int) -> Any:
        """An activation's or a LayerNorm's output whose input was saved just before:
        stored as nothing, remade at unpack from what the input's holder unpacks (see
        :mod:`lightning_acgc.engine.derive`). None where it is not such an output (the
        caller packs it as usual). The site's record names the input's site
        (``derived_from``) and, on the policy's measuring steps, the mean factor (``gain``)
        by which the input's rounding variance reaches it."""
        base = t if t._base is None else t._base
        name = type(base.grad_fn).__name__
        if name not in derive.ELEMENTWISE_NODES and name != derive.LAYER_NORM_NODE:
            return None
        recent = [entry for entry in self._recent if entry[2] is not None]
        plan = derive.derive_plan(t, [entry[2] for entry in recent])
        if plan is None:
            return None
        entries = [recent[i] for i in plan.sources]
        sources = [ref_() if holder is None else holder() for ref_, holder, _, _ in entries]
        if any(s is None for s in sources):
            return None
        saved = Saved(None, None, site.key, "recomputed", sources=tuple(sources), recompute=plan.fn)
        self._dedup[key] = (ref, weakref.ref(saved))
        source = sources[0]
        of = source.site if isinstance(source, Saved) else "its input"
        rec = self._record(site, t, "recomputed", f"{plan.name} of {of}", raw, 0)
        if isinstance(source, Saved):
            rec.derived_from = source.site
            held = [entry[3] for entry in entries]
            if held[0] is not None:  # a measuring step: the input itself is at hand
                values = [
                    h if h is not None else _values_of(s)
                    for h, s in zip(held, sources, strict=True)
                ]
                rec.gain = plan.gain(*values)
        return saved

    def _remember(self, t: torch.Tensor, held: Any) -> None:
        """Note ``t``, just saved, and what the engine returned for it (None: ``t``
        itself): a reduction result or an activation's output saved next may be made from
        it. Where the policy derives activations' outputs, also ``t``'s origin in the graph
        (:class:`~lightning_acgc.engine.derive.Origin`: the node that made it, held
        until backward begins or the step ends) and, on the policy's measuring steps,
        ``t`` itself, to measure ``f'(t)²`` on."""
        holder = weakref.ref(held) if isinstance(held, Saved) else None
        origin = strong = None
        if getattr(self.policy, "derives_elementwise", False) and t.is_floating_point():
            origin = derive.Origin.of(t)
            strong = t if getattr(self.policy, "measuring", False) else None
        self._recent.append((weakref.ref(t), holder, origin, strong))


def _values_of(source: Saved | torch.Tensor) -> torch.Tensor:
    return source.peek() if isinstance(source, Saved) else source
