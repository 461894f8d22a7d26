"""Saved tensors the engine stores as nothing and remakes at unpack from tensors saved
just before them: reduction results their backward compares with their inputs
(:mod:`lightning_acgc.engine.exact`) and, where the policy asks, activations'
and LayerNorm outputs (:mod:`lightning_acgc.engine.derive`)."""

from __future__ import annotations

import itertools
import weakref
from typing import Any, NamedTuple

import torch

from lightning_acgc.engine import derive, exact, extremum, sites
from lightning_acgc.engine.derive_attention import Find, attention_output, fused_attention
from lightning_acgc.engine.derive_graph import check_unchanged, placed
from lightning_acgc.engine.derive_rotary import rotary, rotary_output
from lightning_acgc.engine.derive_softmax import SoftmaxChecks, softmax_of_product, softmax_output
from lightning_acgc.engine.derive_view import cast_plan, is_cast, view_plan
from lightning_acgc.engine.meter import SiteRecord
from lightning_acgc.engine.product_choice import ProductChoice
from lightning_acgc.engine.saved import Saved
from lightning_acgc.engine.sites import SiteInfo

__all__ = ["Recent", "Recomputing"]


class Recent(NamedTuple):
    """A tensor just saved: a weak reference to it, a weak reference to what the engine
    returned for it (None: the tensor itself), and, where the policy derives outputs, its
    origin in the graph and (on measuring steps) the tensor itself."""

    tensor: weakref.ReferenceType
    holder: weakref.ReferenceType | None
    origin: derive.Origin | None
    strong: torch.Tensor | None

    def source(self) -> Saved | torch.Tensor | None:
        """What a recomputation reads: the holder, or the tensor returned as it is."""
        return self.tensor() if self.holder is None else self.holder()


class Recomputing:
    """Mixin of :class:`~lightning_acgc.engine.compressor.ActivationCompressor`; uses its
    ``policy``, ``inputs``, ``_recent``, ``_dedup``, ``_keep`` and ``_record``. Whether the policy
    derives outputs is read at each save: the batch-size search swaps the policy for the
    identity control for a while. ``_products`` holds which products are remade,
    ``_softmax_checks`` which attentions' probabilities were given back by their remaking
    (derive_softmax)."""

    policy: Any
    inputs: Any  # the step's batch (engine/step_inputs.py)
    _recent: Any
    _dedup: dict[tuple, tuple[Any, weakref.ReferenceType]]
    _ledger: Any
    _products: ProductChoice
    _softmax_checks: SoftmaxChecks
    _peeking: list | None = None  # the holders handed to the unpack hook (see _locator)
    stats: Any
    compress_loss: bool
    low_peak: bool
    remake_products: bool

    def _start_remaking(self) -> None:
        """No product chosen, no site's probabilities checked (a new engine)."""
        self._products = ProductChoice()
        self._softmax_checks = SoftmaxChecks()

    def _forget_remaking(self) -> None:
        """Drop the choices and verdicts (the engine removed: the next fit makes them)."""
        self._products.forget()
        self._softmax_checks.forget()

    def _keep(self, *args: Any, **kwargs: Any) -> Saved:
        raise NotImplementedError

    def _record(self, *args: Any) -> SiteRecord:
        raise NotImplementedError

    def _recomputed(
        self, site: SiteInfo, t: torch.Tensor, key: tuple, ref: Any, raw: int,
        sources: list[Saved | torch.Tensor], fn: Any, settings: str, stored: int = 0,
    ) -> tuple[Saved, SiteRecord]:  # fmt: skip
        """What autograd holds for ``t``, made by ``fn`` from ``sources`` at unpack; the
        holder charged ``stored`` bytes (a mask among the sources; else nothing), the site
        recorded with ``settings``."""
        saved = Saved(None, None, site.key, "recomputed", sources=tuple(sources), recompute=fn)
        saved.keep_sources = not self.low_peak
        if stored:
            self._ledger.hold_packed(saved, stored)
            self.stats.packed_bytes += stored
        self._dedup[key] = (ref, weakref.ref(saved))
        return saved, self._record(site, t, "recomputed", settings, raw, stored)

    def _as_is(self, site: SiteInfo, t: torch.Tensor, key: tuple, ref: Any, raw: int) -> Any:
        """What the engine holds for ``t`` whatever the policy, or None: a parameter's copy
        in another dtype (:mod:`~lightning_acgc.engine.param_casts`), or the batch's
        (:meth:`~lightning_acgc.engine.step_inputs.StepInputs.cast_source`), stored as
        nothing and cast again at unpack (bit-identical; under the identity control, held
        as plain autograd holds it); a parametrization's weight
        (:mod:`~lightning_acgc.engine.param_weights`), a row statistic
        (:func:`~lightning_acgc.engine.sites.is_row_statistic`) or a norm statistic
        (:func:`~lightning_acgc.engine.sites.is_norm_statistic`) kept as it is."""
        control = getattr(self.policy, "control", False)  # the identity: all held as is
        param = None if control else self.tracker.frozen.source(t)
        source = None if control or param is not None else self.inputs.cast_source(t)
        if param is None and source is None:
            if self.tracker.weights.holds(t):  # a parametrization's (param_weights.py)
                return self._keep(site, t, key, ref, raw, "computed weight")
            before = (entry.tensor() for entry in itertools.islice(reversed(self._recent), 4))
            # (``before`` is read only for a floating tensor without history: lazily)
            if sites.is_row_statistic(t, before):  # an attention's log-sum-exp
                return self._keep(site, t, key, ref, raw, "row statistic")
            if not sites.is_norm_statistic(site.module_type, t):
                return None
            return self._keep(site, t, key, ref, raw, "norm statistic")
        base = t._base if t._base is not None else t
        view, dtype = placed(t, base), base.dtype
        if param is not None:
            held, what, settings = param, "a parameter", "cast again from its parameter"
        else:  # autocast's copy of the batch
            held, what, settings = source, "the step's input", "cast again from the step's input"
        unchanged = check_unchanged(f"{what} whose autocast copy is cast again", held)

        def cast_again(p: torch.Tensor) -> torch.Tensor:
            unchanged()
            with torch.no_grad():
                return view(p.detach().to(dtype))

        return self._recomputed(site, t, key, ref, raw, [held], cast_again, settings)[0]

    def _comparing(self, site: SiteInfo, t: torch.Tensor, key: tuple, ref: Any, raw: int) -> Any:
        """A reduction result its backward compares with its inputs (amax, ...; see
        :mod:`lightning_acgc.engine.exact`): recomputed at unpack from what its inputs'
        holders unpack (nothing stored), or kept as it is where they are not found."""
        recent = list(self._recent)
        plan = exact.recompute_plan(t, [entry.tensor() for entry in recent])
        sources = [entry.source() for entry in recent[len(recent) - plan[1] :]] if plan else []
        if plan is None or any(s is None for s in sources):
            return self._keep(site, t, key, ref, raw, "compared by its backward")
        named = [s.site for s in sources if isinstance(s, Saved)]
        settings = f"from {', '.join(named) or 'its inputs'}"
        exact_inputs = [entry.tensor() for entry in recent[len(recent) - plan[1] :]]
        stored = _keep_extrema(t, sources, exact_inputs)  # exact maxima through rounding
        if stored:
            settings = f"{settings}, its extrema kept"
        return self._recomputed(site, t, key, ref, raw, sources, plan[0], settings, stored)[0]

    def _derived(self, site: SiteInfo, t: torch.Tensor, key: tuple, ref: Any, raw: int) -> Any:
        """An activation's or a LayerNorm's output whose input was saved just before:
        stored as nothing, remade at unpack from what the input's holder unpacks (see
        :mod:`lightning_acgc.engine.derive`; a tensor of an elementwise module's call:
        :mod:`lightning_acgc.engine.replay`). None where it is not such an output (the
        caller packs it as usual). The site's record names the input's site
        (``derived_from``) and, on the policy's measuring steps, the mean factor (``gain``)
        by which the input's rounding variance reaches it."""
        replays = self.tracker.replays
        derivable = derive.derived_output(t)
        # a view of one saved (its storage saved before: ``raw`` 0), or a cast of one?
        viewed = t._base is not None and raw == 0
        another = viewed or is_cast(t)
        # a rotated query or key? (a product remade: not where products are stored)
        base = t if t._base is None else t._base
        rotated = self.remake_products and not derivable and rotary(base)
        # a fused attention's output (derive_attention; a view of one saved: derive_view)
        attended = self.remake_products and not viewed and fused_attention(base)
        # an eager attention's probabilities (derive_softmax; a view of them: derive_view)
        scored = self.remake_products and not viewed and softmax_of_product(base)
        candidate = derivable or another or rotated or attended or scored
        if not candidate and not replays.candidate(site.module, t):
            return None
        if site.outside_every_module and not self.compress_loss:
            return None  # the loss's tensors: as float16 (EngineSettings.compress_loss)
        recent = [entry for entry in self._recent if entry.origin is not None]
        origins = [entry.origin for entry in recent]
        # a tensor of a module's call written op by op, remade by running it again
        # (replay.py: first, its gain measured through the whole call), else by its op
        plan = replays.plan(site.module, site.ordinal, t, origins)
        if plan is None and derivable:
            plan = derive.derive_plan(t, origins, self._locator(recent), self.remake_products)
        if plan is None and rotated:  # (derive_rotary)
            plan = rotary_output(t, base, origins, self._locator(recent, exact=False))
        if plan is None and attended:  # (derive_attention)
            plan = attention_output(t, base, self._finder(recent))
        if plan is None and scored:  # (derive_softmax: once checked on a measuring step)
            plan = softmax_output(t, base, self._finder(recent))
            if plan is not None and not self._softmax_given_back(site.key, t, plan, recent):
                plan = None
        if plan is None and viewed:  # another view of one saved (derive_view)

            def current(i: int, u: torch.Tensor) -> bool:  # u packed at this version
                refs = self._dedup.get((key[0], u.storage_offset(), *_layout(u), key[5]))
                return refs is not None and refs[1]() is recent[i].source()

            plan = view_plan(t, [entry.tensor() for entry in recent], current)
        if plan is None and another:  # a cast of one saved (derive_view)
            plan = cast_plan(t, origins)
        if plan is None:
            return None
        entries = [recent[i] for i in plan.sources]
        sources = [entry.source() for entry in entries]
        if any(s is None for s in sources) or any(_remade(sources[k]) for k in plan.stored):
            return None
        if plan.max_depth is not None and any(_depth(s) > plan.max_depth for s in sources):
            return None
        if plan.multiplies and not self._product_allowed(site.key, t, plan.multiplies, sources):
            return None
        if plan.claim is not None:
            plan.claim()
        roots = [sources[k] for k in plan.roots]
        of = ", ".join(r.site if isinstance(r, Saved) else "its input" for r in roots)
        bits = [] if plan.kept is None else [plan.kept]  # a mask: 1 bit a value
        saved, rec = self._recomputed(
            site, t, key, ref, raw, [*sources, *bits], plan.fn, f"{plan.name} of {of}",
            sum(b.numel() for b in bits),
        )  # fmt: skip
        # the gains measured last (a record lives across steps), measured again on the
        # policy's measuring steps from the inputs themselves, where at hand
        gains = (rec.gain, *(g for _, g in rec.also_from))
        if getattr(self.policy, "measuring", False):
            values = [_at_hand(e, s) for e, s in zip(entries, sources, strict=True)]
            got = plan.gain(*values, *bits)
            gains = got if isinstance(got, tuple) else (got,)
        if len(gains) != len(roots):  # first seen, or the derivation changed
            gains = (1.0,) * len(roots)
        if plan.multiplies:
            self._products.made(site.key, t.numel(), plan.multiplies)
        held = [(r.site, g) for r, g in zip(roots, gains, strict=True) if isinstance(r, Saved)]
        if held:
            (rec.derived_from, rec.gain), rec.also_from = held[0], tuple(held[1:])
        return saved

    def _softmax_given_back(
        self, key: str, t: torch.Tensor, plan: derive.Derivation, recent: list[Recent]
    ) -> bool:
        """Whether site ``key``'s probabilities may be remade by ``plan``: checked
        against ``t`` where the exact operands are at hand (a measuring step), else as
        last checked (:class:`~lightning_acgc.engine.derive_softmax.SoftmaxChecks`)."""
        entries = [recent[i] for i in plan.sources]
        values = [_at_hand(e, e.source()) for e in entries]
        if any(v is None for v in values):
            return self._softmax_checks.passed(key)
        kept = [] if plan.kept is None else [plan.kept]
        return self._softmax_checks.check(key, lambda: plan.fn(*values, *kept), t)

    def _locator(self, recent: list[Recent], exact: bool = True) -> derive.Locate:
        """``locate(node, attr)`` for :func:`~lightning_acgc.engine.derive.derive_plan`:
        the position in ``recent`` of what the engine returned when autograd saved
        ``node``'s ``attr``, where it gives the values back exactly (the tensor itself,
        one kept as it is, or the lossless ``mask`` codec's; ``exact=False``: whatever
        it gives back, a rotation's tables); else None. Autograd is
        asked which holder it keeps (the unpack hook, while ``_peeking``, only notes the
        holder it is given), so no order of saves is assumed."""

        find = self._finder(recent)

        def locate(node: object, attr: str) -> int | None:
            return find(node, attr, exact)[1]

        return locate

    def _finder(self, recent: list[Recent]) -> Find:
        """``find(node, attr, exact)``: whether ``node`` saved a tensor as ``attr`` (not
        None), and :meth:`_locator`'s position of its holder."""

        def find(node: object, attr: str, exact: bool) -> tuple[bool, int | None]:
            self._peeking = []
            try:
                getattr(node, attr)
            except RuntimeError:  # not saved (or freed)
                return True, None
            finally:
                held, self._peeking = self._peeking, None
            if len(held) != 1 or (exact and not _exact(held[0])):
                return bool(held), None
            return True, next((i for i, e in enumerate(recent) if e.source() is held[0]), None)

        return find

    def _product_allowed(
        self, key: str, t: torch.Tensor, multiplies: int, sources: list[Saved | torch.Tensor]
    ) -> bool:
        """Whether the product ``t`` saved by site ``key`` may be remade from ``sources``:
        not from a tensor remade from a remade one (no chains of products run again), and
        not where it yields to a later product (:mod:`~.product_choice`). A blocked
        product is reported to the choice with the products that blocked it."""
        twice = [s for s in sources if _remade_twice(s)]
        if twice:
            by = [r.site for s in twice for r in s.sources if _remade(r)]  # type: ignore[union-attr]
            self._products.blocked(t.numel(), multiplies, by)
            return False
        return self._products.allowed(key)

    def _remember(self, t: torch.Tensor, held: Any) -> None:
        """Note ``t``, just saved, and what the engine returned for it (None: ``t``
        itself): a reduction result or an activation's output saved next may be made from
        it. Where the policy derives outputs, also ``t``'s origin in the graph
        (:class:`~lightning_acgc.engine.derive.Origin`: the node that made it, held
        until backward begins or the step ends) and, on the policy's measuring steps,
        ``t`` itself, to measure ``f'(t)²`` on."""
        holder = weakref.ref(held) if isinstance(held, Saved) else None
        origin = strong = None
        derivable = t.is_floating_point() or t.dtype == torch.bool  # (a fused dropout's mask)
        if derivable and getattr(self.policy, "derives_elementwise", False):
            origin = derive.Origin.of(t)
            strong = t if getattr(self.policy, "measuring", False) else None
        recent = self._recent
        if len(recent) >= STRONG_WINDOW and recent[-STRONG_WINDOW].strong is not None:
            recent[-STRONG_WINDOW] = recent[-STRONG_WINDOW]._replace(strong=None)
        recent.append(Recent(weakref.ref(t), holder, origin, strong))


# on measuring steps the last saves are held as they are (for their gains), no more
STRONG_WINDOW = 8


def _layout(u: torch.Tensor) -> tuple:
    return tuple(u.shape), u.stride(), u.dtype


def _remade(source: Saved | torch.Tensor) -> bool:
    return isinstance(source, Saved) and source.recompute is not None


def _exact(held: object) -> bool:
    """Whether ``held``, what the pack hook returned, unpacks to the saved values
    exactly: the tensor itself, a tensor kept as it is (not waiting in a chunk of small
    tensors, whose codec may round), or a lossless mask."""
    if not isinstance(held, Saved):
        return isinstance(held, torch.Tensor)
    if held.recompute is not None or held.chunk is not None:
        return False
    return held.raw is not None or held.name == "mask"


def _depth(source: Saved | torch.Tensor) -> int:
    """How many remakings deep ``source`` is: 0 for a stored tensor, 1 for one remade from
    stored ones, ..."""
    if not _remade(source):
        return 0
    return 1 + max((_depth(s) for s in source.sources), default=0)  # type: ignore[union-attr]


def _remade_twice(source: Saved | torch.Tensor) -> bool:
    """Whether ``source`` is remade from a tensor remade itself."""
    return _remade(source) and any(_remade(s) for s in source.sources)  # type: ignore[union-attr]


def _at_hand(entry: Recent, source: Saved | torch.Tensor) -> torch.Tensor | None:
    """A source's values where they cost nothing: the tensor itself (held on measuring
    steps), a tensor kept as it is; None for a packed one (not decoded for a gain)."""
    if entry.strong is not None:
        return entry.strong
    if isinstance(source, Saved):
        return source.raw
    return source


def _keep_extrema(
    result: torch.Tensor,
    sources: list[Saved | torch.Tensor],
    inputs: list[torch.Tensor | None],
) -> int:
    """Patch the holders of a max/min reduction's compared inputs so that their decoded
    values keep the forward's extrema (:mod:`lightning_acgc.engine.extremum`); the bytes
    the patches hold, their masks and the result once (0: none made). A holder that is
    the tensor itself, or kept as it is, needs none."""
    if any(t is None for t in inputs):
        return 0
    if len(sources) == 3:  # a scatter or index reduction: (index, self, src)
        index = sources[0]
        at_unpack = index.peek if isinstance(index, Saved) else lambda: index
        both = extremum.scatter_patches(result, tuple(inputs), at_unpack)  # type: ignore[arg-type]
        targets = list(zip(sources[1:], both, strict=True)) if both else []
    else:
        patch = extremum.extremum_patch(result, inputs[-1])  # type: ignore[arg-type]
        targets = [(sources[-1], patch)] if patch is not None else []
    stored, top = 0, None
    for holder, patch in targets:
        if isinstance(holder, Saved) and holder.raw is None:
            holder.patches = (*holder.patches, patch)
            stored, top = stored + patch.bits.numel(), patch.extremum
    return stored + top.numel() * top.element_size() if top is not None else 0
