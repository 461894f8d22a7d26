"""The saved-tensor hooks: every tensor autograd saves is packed by the site's codec."""

from __future__ import annotations

import collections
import contextlib
import gc
import sys
import warnings
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn

from lightning_acgc.codecs.base import Codec, Packed
from lightning_acgc.codecs.half import HalfCodec, HalfConfig
from lightning_acgc.codecs.intpack import IntPackCodec, IntPackConfig
from lightning_acgc.codecs.mask import MaskCodec, MaskConfig
from lightning_acgc.engine import exact, sites
from lightning_acgc.engine.checks import PendingChecks
from lightning_acgc.engine.coalesce import Coalescer
from lightning_acgc.engine.derive_dropout import without_history
from lightning_acgc.engine.layout import compact
from lightning_acgc.engine.ledger import (
    OOM_MESSAGE,
    Ledger,
    MemoryBudgetError,
    check_budget,
    storage_ref,
)
from lightning_acgc.engine.meter import LOSS_HALF, CompressionStats, SiteRecord
from lightning_acgc.engine.policy import Policy
from lightning_acgc.engine.recompute import Recomputing
from lightning_acgc.engine.saved import Saved
from lightning_acgc.engine.seeds import site_seed
from lightning_acgc.engine.settings import EngineSettings
from lightning_acgc.engine.sites import ModuleTracker, SiteInfo, is_leaf_parameter
from lightning_acgc.engine.step_inputs import StepInputs

__all__ = ["OOM_MESSAGE", "ActivationCompressor", "MemoryBudgetError"]


class ActivationCompressor(Recomputing):
    """Packs saved activations with a policy's codecs and counts the bytes.

    Used through :func:`lightning_acgc.compress_activations` from plain PyTorch, or by
    the Lightning adapter, which calls :meth:`install` on fit start, :meth:`scope`
    around each training step and :meth:`remove` on fit end.

    Args:
        policy: chooses each site's codec (see :class:`lightning_acgc.policies.Policy`).
        model: the model whose modules name the sites; ``None`` names them by type and
            order of appearance (any module run by this thread).
        settings: ``min_numel``, ``seed``, ``compress_masks``, ``strict`` and the rest (see
            :class:`EngineSettings`; default: its defaults).
        keep_packed: keep every :class:`Packed` of the step in ``packed_log`` (tests).
        memory_budget: bytes; packing a tensor that would take the live saved bytes
            plus ``budget_base`` past it raises :class:`MemoryBudgetError`.
        budget_base: bytes counted against the budget besides activations (weights,
            gradients, optimizer state).

    ``offload_exact`` (default ``False``; the batch-size search sets it on a GPU when it
    raised the batch): the exact-gradient passes of calibration steps keep their saved
    tensors in host memory, since they run uncompressed at a batch size that device
    memory may only hold compressed. ``inputs`` (:class:`StepInputs`): the step's batch,
    held by the caller all along: saved as it is, counted as neither saved nor kept.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        model: nn.Module | None = None,
        settings: EngineSettings | None = None,
        keep_packed: bool = False,
        memory_budget: int | None = None,
        budget_base: int = 0,
    ) -> None:
        self.policy = policy
        self.tracker = ModuleTracker(model)
        self.tracker.replays.policy = lambda: self.policy  # (read at each call: replay.py)
        self.stats = CompressionStats()
        settings = settings or EngineSettings()
        self.min_numel = settings.min_numel
        self.coalesce_min = settings.coalesce_min_numel
        self.seed = settings.seed
        self.compress_masks = settings.compress_masks
        self.compress_loss = settings.compress_loss
        self.low_peak = settings.low_peak
        self.remake_products = settings.remake_products
        self.strict = settings.strict
        self.memory_budget = memory_budget
        self.budget_base = budget_base
        self.offload_exact = False
        self.packed_log: list[Packed] | None = [] if keep_packed else None
        self.step = 0
        self._mask_codec = MaskCodec(MaskConfig())
        self._int_codec = IntPackCodec(IntPackConfig())  # integers: lossless
        self._loss_codec = HalfCodec(HalfConfig())  # the loss's log-probabilities
        self._fixed_settings = {  # the engine's own codecs, described without the policy
            id(self._mask_codec): "1 bit",
            id(self._int_codec): "lossless",
            id(self._loss_codec): LOSS_HALF,
        }
        # the policy's text of each codec it hands out (configs are frozen): once per codec
        # (describing a config's fields took 2.5 us a save, the cache 0.15 us)
        self._described: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._resident: set[int] = set()
        self.inputs = StepInputs()  # the step's batch (see step_inputs.py)
        self._ledger = Ledger(self.stats, self._check_budget)
        # small float tensors, encoded in chunks
        self._small = Coalescer(self._ledger, self.stats, self._codec_failed, self.packed_log)
        self._checks = PendingChecks(self._recharge)  # encodes whose device check is out
        self._dedup: dict[tuple, tuple[Any, weakref.ReferenceType]] = {}
        # the tensors saved last and what the engine returned (None: the tensor itself),
        # oldest first: what is saved next may be made from them (exact.py, derive.py)
        self._recent: collections.deque = collections.deque(maxlen=48)  # of Recent
        self._start_remaking()  # which products and probabilities are remade (recompute.py)
        self._site_hash: dict[str, int] = {}
        self._warned: set[str] = set()
        self._paused = 0
        self._installed = False
        attach = getattr(policy, "attach", None)  # optional: a bare codec chooser needs none
        if attach is not None:
            attach(self)

    # -- lifecycle ------------------------------------------------------------
    def install(self) -> None:
        """Register the module hooks that name sites (idempotent)."""
        if not self._installed:
            self.tracker.install()
            self._resident = self.tracker.resident_storages()
            self._installed = True

    def remove(self) -> None:
        """Remove every hook this object registered and forget per-step state."""
        self.tracker.remove()
        self._checks.settle_all()
        self._small.close("engine removed")
        self._dedup.clear()
        self._recent.clear()
        self._forget_remaking()
        self.inputs.clear()
        self._ledger.new_step()
        self._installed = False

    @property
    def installed(self) -> bool:
        return self._installed

    def new_step(self, step: int | None = None) -> None:
        """Start counting a new step (sites are numbered per step). Bytes still live
        from earlier steps stay charged while autograd holds them; under a memory
        budget, graphs kept only by reference cycles (a step that raised) are collected
        first, so they do not count against this step."""
        if self.stats.live_bytes and self.memory_budget is not None:
            gc.collect()
        self.step = self.step + 1 if step is None else step
        self._checks.settle_all()
        self.stats.reset()
        self.tracker.new_step()
        self._small.close("step ended")
        self._dedup.clear()
        self._recent.clear()
        self._ledger.new_step()
        if self.packed_log is not None:
            self.packed_log.clear()

    @contextlib.contextmanager
    def scope(self) -> Iterator[CompressionStats]:
        """Saved tensors made inside are packed; always exits the hooks. Small tensors
        still waiting in a chunk are encoded on exit (kept raw if the scope raised)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            try:
                yield self.stats
            except BaseException:
                self._small.close("step raised")
                raise
            self._small.flush()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Saved tensors made inside are kept as they are (e.g. an exact reference pass)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- hooks ----------------------------------------------------------------
    def _seed_for(self, site: SiteInfo) -> int:
        return site_seed(self.seed, self.step, site.key, self._site_hash)

    def _record(
        self, site: SiteInfo, t: torch.Tensor, codec: str, settings: str, raw: int, kept: int
    ) -> SiteRecord:
        key = site.key
        rec = self.stats.sites.get(key)
        if rec is None:
            rec = self.stats.sites[key] = SiteRecord(
                key,
                site.module,
                site.module_type,
                tuple(t.shape),
                str(t.dtype).removeprefix("torch."),
                codec,
                settings,
            )
        rec.raw_bytes += raw
        rec.packed_bytes += kept
        if kept:
            rec.tensor_bytes += t.numel() * t.element_size()
        rec.count += 1
        return rec

    def _settings_of(self, codec: Codec) -> str:
        """The text of ``codec``'s settings for the site table: the engine's own, or the
        policy's, asked once per codec object."""
        text = self._fixed_settings.get(id(codec))
        if text is None:
            try:
                text = self._described.get(codec)
                if text is None:
                    text = self._described[codec] = self.policy.describe(codec)
            except TypeError:  # a codec without weak references: described each time
                text = self.policy.describe(codec)
        return text

    def _check_budget(self, nbytes: int) -> None:
        check_budget(self.memory_budget, self.budget_base, self.stats.live_bytes, nbytes)

    def _codec_failed(self, site: str, codec: Codec, err: Exception, then: str = "") -> None:
        """Re-raise ``err`` under ``strict``; else warn once per site (``then``: what next)."""
        if self.strict:
            raise err
        if site not in self._warned:
            self._warned.add(site)
            warnings.warn(
                f"lightning_acgc: {codec.name} failed at {site} ({err}); "
                f"{then or 'kept uncompressed'}",
                stacklevel=3,
            )

    def _join(
        self, site: SiteInfo, t: torch.Tensor, key: tuple, ref: Any, raw: int, codec: Codec
    ) -> Saved:
        """Hold the small tensor ``t`` raw until its chunk is encoded with others."""
        detached = t.detach()
        part, layout = compact(detached)
        saved = Saved(None, None, site.key, codec.name, raw=detached, layout=layout)
        self._record(site, t, codec.name, self._settings_of(codec), raw, 0)
        self._dedup[key] = (ref, weakref.ref(saved))
        saved.chunk, saved.member = self._small.join(
            saved, site.key, t, part, ref, codec, lambda: self._seed_for(site)
        )
        return saved

    def _keep(
        self, site: SiteInfo, t: torch.Tensor, key: tuple, ref: Any, raw: int, why: str,
        name: str = "kept",
    ) -> Saved:  # fmt: skip
        """Hold ``t`` as it is; its storage (``ref``) is charged once however many views
        are kept."""
        saved = Saved(None, None, site.key, name, raw=t.detach())
        kept = self._ledger.hold_raw(saved, t, ref)
        self.stats.tensors_kept += 1
        self.stats.packed_bytes += kept
        self._dedup[key] = (ref, weakref.ref(saved))
        self._record(site, t, name, why, raw, kept)
        return saved

    def _pack(self, t: torch.Tensor) -> Any:
        held = self._pack_one(t, sys._getframe(1))
        self._remember(t, held)  # weakly: a graph freed early releases its holders at once
        return held

    def _pack_one(self, t: torch.Tensor, caller: FrameType | None = None) -> Any:
        if self._paused or t.layout != torch.strided or t.device.type == "meta":
            return t
        if t.requires_grad and is_leaf_parameter(t):
            return t
        ptr = t.untyped_storage().data_ptr()  # parameters, buffers, the batch: as they are
        if ptr in self._resident or self.inputs.holds_storage(ptr):
            return t
        checkpoint_input = sites.saved_by_checkpoint(caller)  # (the frame that saved t)
        site = self.tracker.next_site(checkpoint_input)
        # The storage's identity (kept from reuse by the weak reference in ``_dedup``)
        # and the view: a Linear on a 3-D input saves a fresh 2-D view each call, so the
        # q, k and v projections of one hidden state share one holder.
        ref = storage_ref(t)  # one weak reference per pack: key, ledger and dedup share it
        key = (ref.cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        raw = self._ledger.count_saved(t, ref)
        # A tensor already taken this step is shared, whatever this site would choose.
        refs = self._dedup.get(key)
        saved = refs[1]() if refs is not None else None
        # (a checkpointed region's input is not left to a lossy holder: sites.SiteInfo)
        if saved is not None and not (checkpoint_input and saved.raw is None):
            rec = self._record(site, t, saved.name, f"shared with {saved.site}", 0, 0)
            rec.shared_with = saved.site
            saved.pending += 1
            if saved.chunk is not None:
                saved.chunk.expect()
            return saved
        control = getattr(self.policy, "control", False)  # the identity: nothing compressed
        if not t.is_floating_point() and control:
            return self._keep(site, t, key, ref, raw, "control")
        if t.grad_fn is not None and type(t.grad_fn).__name__ in exact.COMPARING_NODES:
            return self._comparing(site, t, key, ref, raw)
        derives = getattr(self.policy, "derives_elementwise", False) and not checkpoint_input
        if derives and t.is_floating_point():
            derived = self._derived(site, t, key, ref, raw)
            if derived is not None:
                return derived
        if t.dtype == torch.bool:
            if not self.compress_masks or t.numel() < self.min_numel:
                return self._keep(site, t, key, ref, raw, "bool")
            codec = self._mask_codec
        elif not t.is_floating_point():
            if t.numel() < self.min_numel:
                return self._keep(site, t, key, ref, raw, "tiny")
            codec = self._int_codec
        else:
            small = t.numel() < self.min_numel
            if small and (self.coalesce_min is None or t.numel() < self.coalesce_min):
                return self._keep(site, t, key, ref, raw, "tiny")
            if not self.compress_loss and site.outside_every_module:
                if small or t.dtype != torch.float32 or control:
                    return self._keep(site, t, key, ref, raw, "loss")  # (identity: the control)
                codec = self._loss_codec  # float16: see EngineSettings.compress_loss
            elif (held := self._as_is(site, t, key, ref, raw)) is not None:
                return held  # a parameter's cast (remade), a norm statistic (kept)
            else:
                if self.compress_masks and not small and not control and without_history(t):
                    # a dropout's float mask, at 1 bit losslessly; the codec declines any
                    # tensor of more than two values, which the policy's codec takes
                    held = self._encode(site, t, key, ref, raw, self._mask_codec, or_none=True)
                    if held is not None:
                        return held
                codec = self.policy.codec_for(site, t)
                if codec is None:
                    return self._keep(site, t, key, ref, raw, "policy")
                if codec.name == "identity":
                    return self._keep(site, t, key, ref, raw, "raw", name="identity")
                if small:
                    return self._join(site, t, key, ref, raw, codec)
        return self._encode(site, t, key, ref, raw, codec)

    def _encode(
        self, site: SiteInfo, t: torch.Tensor, key: tuple, ref: Any, raw: int, codec: Codec,
        or_none: bool = False,
    ) -> Saved | None:  # fmt: skip
        """``t`` packed by ``codec`` and held; where the codec declines, kept as it is (or,
        ``or_none``, None: the caller tries another codec)."""
        part, layout = compact(t.detach())
        self._checks.poll()
        try:  # without waiting for the device where the codec can (see engine/checks.py)
            packed = getattr(codec, "encode_deferred", codec.encode)(part, self._seed_for(site))
        except Exception as err:
            self._codec_failed(site.key, codec, err, "its policy's codec next" if or_none else "")
            packed = None
        if packed is None and or_none:
            return None
        if packed is None:
            return self._keep(site, t, key, ref, raw, f"{codec.name} declined")
        nbytes = packed.nbytes
        if nbytes >= part.numel() * part.element_size() and not getattr(codec, "whole", False):
            return self._keep(site, t, key, ref, raw, f"{codec.name} not smaller")
        saved = Saved(packed, codec, site.key, codec.name, layout=layout)
        self._ledger.hold_packed(saved, nbytes)
        self._checks.add(saved)
        self.stats.tensors_packed += 1
        self.stats.packed_bytes += nbytes
        self._dedup[key] = (ref, weakref.ref(saved))
        self._record(site, t, codec.name, self._settings_of(codec), raw, nbytes)
        if self.packed_log is not None:
            self.packed_log.append(packed)
        return saved

    def _recharge(self, saved: Saved, delta: int) -> None:
        """A deferred check replaced ``saved``'s payload: its bytes changed by ``delta``."""
        self._ledger.adjust_packed(saved, delta)
        self.stats.packed_bytes += delta

    def _unpack(self, saved: Any) -> torch.Tensor:
        if self._peeking is not None:  # asked which holder autograd keeps (recompute.py)
            self._peeking.append(saved)
            return torch.empty(0)  # (fresh: autograd may set what it unpacks up)
        if self._recent:  # backward has begun: nothing saved next is made from them
            self._recent.clear()
        if len(self._checks):  # backward has begun: every verdict is needed
            self._checks.settle_all()
        if self._small.open:  # backward has begun: small tensors still waiting are encoded
            self._small.flush()
        if isinstance(saved, Saved):
            return saved.unpack()
        return saved
