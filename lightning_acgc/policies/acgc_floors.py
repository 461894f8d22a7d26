"""Per-tensor width floors from measured per-layer errors (AC-GC, ``quant`` codec).

The error a layer's gradient gets through δ comes mostly from the other-ops tensors
saved next to it: attention's query and key gradients are made of the attention's own
saved tensors (Q, K, V, the probabilities), whose errors do not cancel in the softmax's
backward the way the signal does. At initialization those gradients are 1e-8 of ‖g‖²,
so no global weight λ on the other-ops factors can reach them (λ ran to 256 on BERT and
query/key still measured 8-10x e).

So the measurement acts directly. When a module m's measured error through δ is over
its budget by r (:meth:`ModelCorrections._measure_layers`), the other-ops tensors saved
inside m's parent scope (their module is the parent or below it; where it holds none, the
nearest scope around it that does) get floors: starting
from their widths in force, the fewest added bits (greedy, best modelled error reduction
per bit, :func:`~lightning_acgc.policies.bit_allocation.allocate_to_error`) that cut the
scope's modelled other-ops error Σ o_t·v_t(b_t) by ``MARGIN``·r. Unbiased errors add in variance,
so r is what would have put m on budget; which tensors carry it is the model's guess (the
next calibration corrects it). A floor loosens by at most one width step per
calibration, and only when the worst module of the scope that set it had room for that
step's variance (v_t(lower) / v_t(floor) times its measured error within its budget; from
kept to 8 bits when it used under half its budget). Only that scope's modules count: a
floor set for one block and held by the worst module of the whole model (every module
sits near its own budget, by design) never loosened, and one early miss (step 2 of the
quick ResNet at e = 0.5, a block at 4.9e) kept 47 tensors at 3-7 bits for good: 7.5x at a
measured 0.16-0.27 against e = 0.5.

A softmax's saved output is the exception: where a module directly inside the module
that saved it goes ``SOFTMAX_ALARM`` times over its budget through δ, the probabilities
of that softmax in every block are stored as float16 at least for the rest of the fit
(``SOFTMAX_FLOOR``). (Only where they are stored: an eager attention's probabilities
over a product of its query and key are remade from those, see
:mod:`lightning_acgc.engine.derive_softmax`.)
"""

from __future__ import annotations

import math

import torch

from lightning_acgc.engine.sites import SiteInfo, is_norm_type
from lightning_acgc.policies.acgc_allocation import UNCONSTRAINED, average
from lightning_acgc.policies.acgc_probes import tensor_class
from lightning_acgc.policies.bit_allocation import HALF, KEEP, LADDER, allocate_to_error
from lightning_acgc.policies.checkpoint_regions import RegionKinds
from lightning_acgc.policies.error_model import (
    BIAS_FLOOR,
    SATURATING_TYPES,
    SOFTMAX_TYPES,
    norm_inv_var,
    saturating_output,
    softmax_output,
)

__all__ = ["ScopeFloors", "within"]

ORDER = (*LADDER, KEEP)  # widths from the least to the most bits
# A floor cuts the modelled error by MARGIN·r, not r: which tensors carry a layer's error
# is the model's guess, and one width step (2-4x the error) rarely lands exactly; a floor
# that falls short costs another calibration over budget, one too high loosens later.
MARGIN = 2.0
MASK_FLOOR = 2  # quant keeps a ReLU output's mask (zeros, positives) at 2 bits and more
# A softmax output whose module holds a module at SOFTMAX_ALARM times its budget through δ
# (≈0.84e; the allocation aims at 0.59e) is stored as float16 at least from then on, with
# every tensor of its class (the same softmax in each block), for the rest of the fit.
# Rounding the probabilities moves an attention key's gradient out of all proportion to
# their modelled error: at 8 bits alone 10x the key's bound on some steps of the BERT
# recipe, the probes' factor for them off 100x between calibrations. The BERT recipe's
# fits (seeds 0-2, calibrating every 5 steps) broke the per-layer promise on 7 of 75
# calibrations, then on 1 at the same ratio (5.5x, 6.0x, 5.5x); float16 for every
# softmax output from the start cost the char-LM 30% of its ratio (6.3x -> 4.4x); the
# alarm rang on 1 of its 5 fits (6.4x -> 4.4x), none of which broke the promise.
SOFTMAX_FLOOR = HALF
SOFTMAX_ALARM = 2.0
# A checkpointed region's input (torch.utils.checkpoint, either kind) is stored as
# float16 at least where the region holds an op whose derivative jumps: backward runs
# the region again from it, and a ReLU mask remade from a rounded input flips wherever
# the pre-activation is within the rounding, each flip sending a whole δ element the
# wrong way. The error then grows like the square root of the rounding, not with its
# variance as the error model has it: on the quick ResNet with each residual block
# checkpointed, rounding the block inputs alone put the gradient 0.11-0.19 off at 8 bits
# and 0.027 as float16 (0.0006 as float16 unchecked). Where every op of the region is
# smooth (checkpoint_regions: read off the graph), 8 bits at least: BERT-base, block
# inputs at 8 bits, 0.023 (81x) against 0.021 as float16 (45x).
# Where a calibration measures over e, or a layer inside the region's scope goes over its
# budget all the same (ResNet-50 at batch 4: 0.075 with float16 block inputs), the error
# model cannot say which tensor to widen (it blamed the stem's), so the region's input
# goes one step up, 8 bits -> float16 -> kept as it is (over e: every region's; a layer:
# its class, the same input of every block of a stage), for the rest of the fit.
# Starting as a measured floor that loosens where its scope has room instead went to 8
# bits on the quick ResNet and measured 0.07-0.13.
CHECKPOINT_FLOOR = HALF
SMOOTH_CHECKPOINT_FLOOR = 8
CHECKPOINT_HOLDS = {SMOOTH_CHECKPOINT_FLOOR: HALF, HALF: KEEP}  # one step up per hold


def parent(module: str) -> str:
    """The module's parent scope ("" at the root)."""
    return module.rpartition(".")[0]


def within(module: str, scope: str) -> bool:
    """Whether ``module`` is ``scope`` or below it (the root "" contains every module).

    Example:
        >>> within("a.b.c", "a.b"), within("a.bc", "a.b"), within("x", "")
        (True, False, True)
    """
    return not scope or module == scope or module.startswith(scope + ".")


def _widened(scope_over: dict[str, float], others: dict[str, float]) -> dict[str, float]:
    """Each over-budget scope, or the nearest scope around it that holds other-ops
    tensors: a block under ``torch.utils.checkpoint`` (either kind) saves nothing inside
    it through the hooks, only its input (at the model's root), which
    every layer of the block reads when the block is recomputed; with nothing in their
    own scope to floor, its layers ran over their budgets for the rest of the fit.

    Example:
        >>> _widened({"blocks.0": 2.0, "head": 3.0}, {"blocks.0.fc:0": 1.0, ":0": 1.0})
        {'blocks.0': 2.0, '': 3.0}
    """
    out: dict[str, float] = {}
    for scope, r in scope_over.items():
        while scope and not any(within(k.rpartition(":")[0], scope) for k in others):
            scope = parent(scope)
        out[scope] = max(out.get(scope, 0.0), r)
    return out


def _variance(table: list[float], width: int) -> float:
    return 0.0 if width == KEEP else table[LADDER.index(width)]


class ScopeFloors:
    """Mixin of :class:`~lightning_acgc.policies.acgc.ACGCPolicy`: ``_floors`` (site key →
    smallest width) and ``_floor_scopes`` (site key → the scope that set its floor) from the
    per-layer readings, and each tensor's modelled variance under the settings in force.
    Uses ``site_bits``, ``site_split``, ``bounds``, ``codec``, ``_variances``, ``_sens``,
    ``_raw_bits``, ``_inv_var``, ``_saturating``, ``_step_sens``, ``initial_width``,
    ``_softmax``, ``_softmax_held``, ``_checkpoint_inputs`` and ``_checkpoint_held`` (its
    own),
    ``other_factor``, ``probe_floors`` and ``nonzero_shares``."""

    def __init__(self) -> None:
        super().__init__()
        self._softmax: set[str] = set()  # sites saving a softmax's output
        self._softmax_held: set[str] = set()  # their classes held at SOFTMAX_FLOOR
        self._checkpoint_inputs: set[str] = set()  # sites at a checkpoint floor at least
        self._checkpoint_held: dict[str, int] = {}  # their classes' floors after holds
        self._regions = RegionKinds()  # whether their regions are smooth

    def begin_step(self, step: int) -> None:
        super().begin_step(step)  # type: ignore[misc]
        self._regions.forget()

    def _variance(self, key: str) -> float:
        """Modelled error variance per element of tensor ``key`` under the settings (a
        ``split`` tensor's: its shares' mix of the two widths')."""
        if self.codec == "bounded":
            bound = self.bounds.get(key, UNCONSTRAINED)
            return bound**2 / 3 if bound < UNCONSTRAINED else 0.0
        width = self.site_bits.get(key, self.initial_width)
        table = self._variances.get(key)
        if table is None:
            return 0.0
        share = self.site_split.get(key, 0.0)  # only on widths 2 to 8 (acgc_allocation)
        low = _variance(table, width - 1) if share else 0.0
        return (1 - share) * _variance(table, width) + share * low

    def _update_floors(self, needs: dict[str, float], through_delta: dict[str, float]) -> None:
        """Tighten or loosen the floors of the other-ops tensors around each module.

        Args:
            needs: per module, measured error / budget.
            through_delta: per module, its error not from its own input / that part's budget.
        """
        floors: dict[str, int] = getattr(self, "_floors", None) or {}
        origins: dict[str, str] = getattr(self, "_floor_scopes", None) or {}
        scope_over: dict[str, float] = {}
        for module, r in needs.items():
            scope = parent(module)
            if r > 1 and through_delta.get(module, 0.0) > 1:
                scope_over[scope] = max(scope_over.get(scope, 0.0), through_delta[module])
                if r > SOFTMAX_ALARM:
                    self._hold_softmax(scope)
        others = {
            key: self.other_factor(key, w, o)  # measured where probed (acgc_probes)
            for key, (_, w, o) in average(self._sens).items()
            if key in self._variances
        }
        others = {k: o for k, o in others.items() if o > 0}
        scope_over = _widened(scope_over, others)
        nonzero = self.nonzero_shares()  # type: ignore[attr-defined]
        held = False  # a checkpointed region's input newly kept
        # innermost scopes first: a tensor tightened for an inner scope counts as such
        for scope in sorted(scope_over, key=lambda s: -s.count(".") - bool(s)):
            keys = sorted(k for k in others if within(k.rpartition(":")[0], scope))
            fresh = bool(keys) and self._hold_checkpoint_inputs(keys)
            held |= fresh
            if not keys or fresh:
                continue
            widths = [
                max(
                    self.site_bits.get(k, self.initial_width),
                    floors.get(k, LADDER[0]),
                    key=ORDER.index,
                )
                for k in keys
            ]
            errors = [
                {b: others[k] * _variance(self._variances[k], b) for b in LADDER} for k in keys
            ]
            now = sum(self._variance(k) * others[k] for k in keys)
            sizes = [self._structure_numel(k) for k in keys]
            raws = [self._raw_bits.get(k, 32) for k in keys]
            budget = now / (MARGIN * scope_over[scope])
            shares = [nonzero.get(k, 1.0) for k in keys]
            new = allocate_to_error(sizes, errors, budget, widths, raws, 0.0, shares)
            for key, width in zip(keys, new, strict=True):
                if width != LADDER[0] and width != floors.get(key):
                    floors[key] = width
                    origins[key] = scope
        tightened = {k for s in scope_over for k in others if within(k.rpartition(":")[0], s)}
        self._loosen(floors, origins, others, needs, tightened)
        self._floors = floors
        self._floor_scopes = origins
        if held:  # not only from the next calibration on: the steps until then too
            self._allocate()  # type: ignore[attr-defined]

    def _loosen(
        self,
        floors: dict[str, int],
        origins: dict[str, str],
        others: dict[str, float],
        needs: dict[str, float],
        tightened: set[str],
    ) -> None:
        """Lower floors by one width step each where the scope that set them has room.

        Per scope, its worst module's measured need is scaled by the modelled change of
        the scope's other-ops error Σ o_t·v_t(b_t) (widths in force) as its floors are
        lowered one by one, the smallest modelled increase first; a floor is lowered while
        the scaled need stays within 1 (a floor whose tensor carries little of the scope's
        error loosens although the scope sits near its budget). A kept tensor (no error to
        scale) goes to 8 bits once the scope uses under half its budget."""

        def in_force(key: str) -> int:
            return self.site_bits.get(key, self.initial_width)

        def origin_of(key: str) -> str:  # the scope that set the floor (else its module's)
            return origins.get(key, parent(key.rpartition(":")[0]))

        for origin in sorted({origin_of(k) for k in floors}):
            keys = [k for k in others if within(k.rpartition(":")[0], origin)]
            now = sum(others[k] * self._variance(k) for k in keys)
            need = max((r for m, r in needs.items() if within(m, origin)), default=0.0)
            steps = []
            for key, floor in floors.items():
                if key in tightened or key not in self._variances or origin_of(key) != origin:
                    continue
                lower = ORDER[max(ORDER.index(floor) - 1, 0)]
                width = max(in_force(key), floor, key=ORDER.index)
                after = width if ORDER.index(width) > ORDER.index(floor) else lower
                table, o = self._variances[key], others.get(key, 0.0)
                extra = o * (_variance(table, after) - _variance(table, width))
                steps.append((extra, key, lower))
            for extra, key, lower in sorted(steps):
                if floors[key] == KEEP:
                    room = need <= 0.5
                elif now > 0:
                    room = need * (now + extra) / now <= 1.0
                else:
                    room = extra <= 0
                if not room:
                    continue
                if now > 0:
                    need *= (now + extra) / now
                now += extra
                if lower == LADDER[0]:
                    del floors[key]
                    origins.pop(key, None)
                else:
                    floors[key] = lower

    def _hold_softmax(self, scope: str) -> None:
        """The softmax outputs saved by module ``scope`` itself (the parent of the module
        over budget: an attention whose query, key or fused qkv projection broke; not
        the block around it, whose LayerNorm rang on a char-LM fit at no break): their
        classes to SOFTMAX_FLOOR."""
        for key in self._softmax:
            if key.rpartition(":")[0] == scope:
                self._softmax_held.add(tensor_class(key))

    def _hold_checkpoint_inputs(self, keys: list[str]) -> bool:
        """The classes of the checkpointed regions' inputs among ``keys`` (an over-budget
        scope's tensors) one step up (``CHECKPOINT_HOLDS``) from now on; whether any moved
        (then they, not the scope's other tensors, take this calibration's step)."""
        fresh = False
        for cls in sorted({tensor_class(k) for k in keys if k in self._checkpoint_inputs}):
            now = self._class_floor(cls)
            if now != KEEP:
                self._checkpoint_held[cls] = CHECKPOINT_HOLDS.get(now, KEEP)
                fresh = True
        return fresh

    def hold_all_checkpoint_inputs(self) -> None:
        """A calibration measured over e: every checkpointed region's input goes one step
        up from now on, and the settings in force are allocated again (ResNet-50 at batch
        4 measured 0.075 on its first calibration with float16 block inputs; the layers'
        readings, with κ just tightened by that miss, rang only on the third)."""
        if self._hold_checkpoint_inputs(sorted(self._checkpoint_inputs)) and self._predicted:
            self._allocate()  # type: ignore[attr-defined]

    def note_tensor(self, site: SiteInfo, x: torch.Tensor) -> None:
        """On a calibration step, what the error model reads off a saved tensor itself: a
        normalization input's 1/variance, and whether a saturating activation saved it (by
        its module's type, or by the autograd node that made it: F.softmax inside an
        attention module has that module's type)."""
        if is_norm_type(site.module_type):
            inv_var = norm_inv_var(x, site.module_type)
            if inv_var is not None and math.isfinite(inv_var):
                self._inv_var[site.key] = inv_var
        if site.module_type in SATURATING_TYPES or saturating_output(x):
            self._saturating.add(site.key)
        if site.module_type in SOFTMAX_TYPES or softmax_output(x):
            self._softmax.add(site.key)
        if site.checkpoint_input:
            self._checkpoint_inputs.add(site.key)
            self._regions.note(tensor_class(site.key), x)

    def first_width(self, site: SiteInfo) -> int:
        """The width of a site the allocation has not set yet: ``initial_width``, or its
        checkpoint floor for a checkpointed region's input."""
        if not site.checkpoint_input:
            return self.initial_width
        return max(self.initial_width, self._checkpoint_floor(site.key), key=ORDER.index)

    def _checkpoint_floor(self, key: str) -> int:
        return self._class_floor(tensor_class(key))

    def _class_floor(self, cls: str) -> int:
        """A class of checkpointed regions' inputs: its floor after holds, else 8 bits
        where its regions are smooth, float16 where not (or not known)."""
        held = self._checkpoint_held.get(cls)
        if held is not None:
            return held
        return SMOOTH_CHECKPOINT_FLOOR if self._regions.smooth(cls) else CHECKPOINT_FLOOR

    def floors(self) -> dict[str, int]:
        """The smallest width per tensor the allocation must respect: the measured floors,
        the probes' (:mod:`~lightning_acgc.policies.acgc_probes`), and
        :data:`~lightning_acgc.policies.error_model.BIAS_FLOOR` for the saved outputs of
        saturating activations (a bias, not a variance: the error model does not see it),
        the checkpoint floors (or kept) for checkpointed regions' inputs, and
        ``MASK_FLOOR`` for ReLU outputs the model counts exact in their ReLU's backward
        (quant keeps zeros and positives apart from 2 bits up, not at 1)."""
        floors = dict(getattr(self, "_floors", None) or {})
        for key, width in self.probe_floors().items():  # acgc_probes: PROBE_WIDTH
            floors[key] = max(floors.get(key, LADDER[0]), width, key=ORDER.index)
        for key in self._saturating:
            floors[key] = max(floors.get(key, LADDER[0]), BIAS_FLOOR, key=ORDER.index)
        for key in self._softmax:
            if tensor_class(key) in self._softmax_held:
                floors[key] = max(floors.get(key, LADDER[0]), SOFTMAX_FLOOR, key=ORDER.index)
        for key in self._checkpoint_inputs:
            width = self._checkpoint_floor(key)
            floors[key] = max(floors.get(key, LADDER[0]), width, key=ORDER.index)
        for key, sens in self._step_sens.items():
            if sens.keeps_mask:  # the model counts its ReLU's backward exact: its mask kept
                floors[key] = max(floors.get(key, LADDER[0]), MASK_FLOOR, key=ORDER.index)
        return floors

    def width_limits(self) -> tuple[dict[str, int], dict[str, float], set[str]]:
        """What :func:`~.acgc_allocation.quant_allocation` reads besides the model: the
        :meth:`floors`, the ``nonzero`` codec's shares, and the tensors read only through
        their mask (a ReLU output nothing else saves: exact at its floor)."""
        exact = {k for k, s in self._step_sens.items() if s.keeps_mask and s.mask_only}
        return self.floors(), self.nonzero_shares(), exact

    def _structure_numel(self, key: str) -> int:
        readings = self._sens.get(key)
        return int(readings[-1][0]) if readings else 1
