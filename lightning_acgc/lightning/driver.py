"""The compression of one fit, as a class that owns its state: the engine, the scope of
``training_step``, the policy's calibration cycle, and the one step counter."""

from __future__ import annotations

import copy
import dataclasses
import zlib
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_acgc.checkpointing import CheckpointedModules
from lightning_acgc.engine.compressor import ActivationCompressor
from lightning_acgc.engine.cycle import CalibrationCycle
from lightning_acgc.engine.settings import EngineSettings
from lightning_acgc.lightning._loop import (
    call_training_step,
    first_train_batch,
    make_reduce,
    offline,
    step_loss,
    training_loss,
)
from lightning_acgc.lightning.halves import split_batch
from lightning_acgc.lightning.memory import static_memory_bytes
from lightning_acgc.lightning.options import policy_text
from lightning_acgc.lightning.scope import CompressionScopeMixin, TrainingStepPatch
from lightning_acgc.policies import Policy

__all__ = ["CalibrationDriver"]


def refuses_hooks(err: RuntimeError) -> bool:
    """Whether ``err`` is PyTorch refusing saved-tensor hooks (``torch.func``'s transforms
    and ``torch.autograd.graph.disable_saved_tensors_hooks`` raise it on entry while any
    are active).

    Example:
        >>> refuses_hooks(RuntimeError("torch.func.{grad, vjp} don't support saved tensor hooks"))
        True
        >>> refuses_hooks(RuntimeError("CUDA out of memory"))
        False
    """
    text = str(err).lower()
    return "saved tensor hooks" in text or "saved tensors default hooks" in text


def loss_scale(trainer: Trainer) -> float:
    """The factor the step's backward scales its loss by: the precision plugin's
    GradScaler's (``precision="16-mixed"``), else 1."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())


def _accumulating(trainer: Trainer) -> bool:
    """Whether the current batch accumulates gradients (no optimizer step after it)."""
    if trainer.accumulate_grad_batches <= 1:
        return False
    should_accumulate = getattr(trainer.fit_loop, "_should_accumulate", None)
    return bool(should_accumulate()) if should_accumulate is not None else False


class CalibrationDriver:
    """Installs the engine on fit start, scopes ``training_step`` (it is the strategies'
    :class:`~lightning_acgc.lightning.scope.Scope`), drives the engine's
    :class:`~lightning_acgc.engine.CalibrationCycle` from the callback's hooks, and
    removes everything on :meth:`stop`.

    ``step`` is the one step counter: the number of compressed ``training_step`` calls
    (the codecs' seeds derive from it). It is checkpointed; a fit starts it at 0 unless
    :meth:`resume` set it from a checkpoint.

    Args:
        policy: the policy of the fit.
        settings: the engine's settings.
        memory_budget: bytes (see :class:`~lightning_acgc.engine.ActivationCompressor`).
        checkpointed: submodules run under ``torch.utils.checkpoint`` while active.
    """

    def __init__(
        self,
        policy: Policy,
        settings: EngineSettings,
        memory_budget: int | None = None,
        checkpointed: CheckpointedModules | None = None,
    ) -> None:
        self.policy = policy
        self.settings = settings
        self.memory_budget = memory_budget
        self.checkpointed = checkpointed
        self.step = 0
        self.engine: ActivationCompressor | None = None
        self.cycle: CalibrationCycle | None = None
        self.active = False
        self._resumed = False
        self._patch: TrainingStepPatch | None = None
        self._strategy: CompressionScopeMixin | None = None
        self._ranks_checked = False
        self._noise_step: int | None = None  # the step whose halves were measured
        self._warned: set[str] = set()
        self._trainer: Trainer | None = None  # of the fit started last
        self._batch: Any = None  # the batch begun, until its training_step runs

    # -- the scope of training_step ------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as the next engine step with compression active.

        Code that refuses saved-tensor hooks (``torch.func.grad``, ``vjp``, ``jacrev``,
        ``hessian``: a physics-informed loss, per-sample gradients) raises as soon as it
        runs under them. Then compression stops for the rest of the fit, with a warning,
        and ``fn`` runs again without it, as plain training would have run it; unless an
        optimizer stepped before the refusal (manual optimization), where running again
        would step it twice: then the error is raised, saying so."""
        assert self.engine is not None
        self.engine.new_step(self.step)
        batch, self._batch = self._batch, None
        self.engine.inputs.hold(batch)  # held by the loop all along: saved as it is
        self.step += 1
        steps = self._optimizer_steps()
        try:
            with self.engine.scope():
                return fn(*args, **kwargs)
        except RuntimeError as err:
            if not refuses_hooks(err):
                raise
            if self._optimizer_steps() != steps:
                raise RuntimeError(
                    "lightning_acgc: training_step runs code that refuses saved-tensor "
                    "hooks (torch.func's grad, vjp, jacrev or hessian) after an optimizer "
                    "step, so it cannot run again uncompressed; call it before the "
                    "optimizer steps, or train this model with ActivationCompression("
                    "policy='off')"
                ) from err
            refusal = str(err).splitlines()[0]
        self.warn_once(
            "refused",
            f"training_step runs code that refuses saved-tensor hooks ({refusal}); "
            "activation compression is off for the rest of this fit, which trains as "
            "plain training does",
        )
        self.stop()
        return fn(*args, **kwargs)

    def _optimizer_steps(self) -> int:
        """Optimizer steps the trainer has taken (0 before :meth:`start`)."""
        return self._trainer.global_step if self._trainer is not None else 0

    def resume(self, step: int, seed: int) -> None:
        """Continue from a checkpoint's step counter and seed."""
        self.step, self._resumed = step, not self.active
        if seed != self.settings.seed:
            self.settings = dataclasses.replace(self.settings, seed=seed)
            if self.engine is not None:
                self.engine.seed = seed

    # -- fit start and end ---------------------------------------------------------
    def start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        budget_base = 0
        if self.memory_budget is not None:
            budget_base = static_memory_bytes(pl_module, trainer.optimizers)
        engine = ActivationCompressor(
            self.policy,
            model=pl_module,
            settings=self.settings,
            memory_budget=self.memory_budget,
            budget_base=budget_base,
        )
        engine.install()
        if not self._resumed:
            self.step = 0
        self._resumed = False
        strategy = trainer.strategy
        try:
            self.engine = engine
            if self.checkpointed is not None:
                self.checkpointed.install(pl_module)
            self.policy.setup(pl_module)
            if isinstance(strategy, CompressionScopeMixin):
                strategy.attach_compression(self)
                self._strategy = strategy
            else:
                self._patch = TrainingStepPatch(strategy, self)
        except BaseException:
            if self.checkpointed is not None:
                self.checkpointed.remove()
            engine.remove()
            raise
        self.cycle = CalibrationCycle(engine, make_reduce(trainer), trainer.world_size)
        self._noise_step = None
        self._trainer = trainer
        self.active = True
        self._ranks_checked = False

    def stop(self) -> None:
        """Undo everything :meth:`start` did (idempotent; also after exceptions)."""
        if self._patch is not None:
            self._patch.restore()
            self._patch = None
        if self._strategy is not None:
            self._strategy.detach_compression()
            self._strategy = None
        if self.checkpointed is not None:
            self.checkpointed.remove()
        if self.engine is not None and self.engine.installed:
            self.engine.remove()
        self._trainer = None
        if self.active:
            self.active = False
            self.cycle = None
            self.policy.teardown()

    # -- one training step ---------------------------------------------------------
    def batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Begin the step; on its batches, the exact gradient if the policy wants it (and
        on its first batch the halves' gradients, for a noise-relative budget)."""
        if not self.active or self.cycle is None:
            return
        self._batch = batch
        wants_exact = self.cycle.begin(trainer.global_step)
        self.cycle.loss_scale = loss_scale(trainer)  # (fp16: the step's, and the passes')
        first_batch = self._noise_step != self.cycle.step
        self._noise_step = self.cycle.step
        if batch is None or not (wants_exact or self._wants_noise()):
            return
        if not self._exact_supported(trainer, pl_module):
            return
        if first_batch:
            self._add_noise_estimate(trainer, pl_module, batch, batch_idx)
        if not wants_exact:
            return
        # Handed over before the forward, as the policy protocol says; with gradient
        # accumulation, before the forward of the step's last batch, with the whole sum.
        loss = step_loss(trainer, pl_module, batch, batch_idx)
        last = not _accumulating(trainer)
        scale = 1.0 / trainer.accumulate_grad_batches
        self.cycle.add_exact_gradient(pl_module, loss, scale=scale, last=last)
        if last:  # (accumulated: on the last batch, read as the step's; cycle.LastBatch)
            self.cycle.add_probes(pl_module, loss)

    def _wants_noise(self) -> bool:
        """Whether the policy wants the halves' gradients on the step begun."""
        wants = getattr(self.policy, "needs_noise_estimate", None)
        step = None if self.cycle is None else self.cycle.step
        return wants is not None and step is not None and bool(wants(step))

    def _add_noise_estimate(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """For a noise-relative budget on a step that wants it: the exact gradients of
        the batch's two halves (before the exact gradient of the whole batch)."""
        assert self.cycle is not None
        if not self._wants_noise():
            return
        halves = split_batch(batch)
        if halves is None:
            fixed = getattr(self.policy, "gradient_error", None)
            bound = (
                f"gradient_error={fixed}"
                if fixed is not None
                else f"the policy's fixed error {getattr(self.policy, 'fallback_error', None)}"
            )
            self.warn_once(
                "halves",
                f"the noise-relative budget needs the batch's two halves, but a batch of type "
                f"{type(batch).__name__} has no batch dimension to cut (a full graph, one "
                "sample, or tensors of different lengths); the budget falls back to "
                f"{bound}. To keep the noise-relative budget, give "
                "training_step a tensor, or a tuple, list or dict of tensors sharing their "
                "first (batch) dimension; or pass gradient_error= to choose the fixed bound",
            )
            return
        losses = tuple(step_loss(trainer, pl_module, h, batch_idx) for h in halves)
        scale = trainer.accumulate_grad_batches**-0.5  # one batch of the step's k
        self.cycle.add_noise_estimate(pl_module, losses, scale)  # type: ignore[arg-type]

    def before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """End the step (once); under DDP, check that the ranks' settings agree."""
        cycle = self.cycle
        if not self.active or cycle is None or not cycle.end(pl_module):
            return
        if trainer.world_size > 1 and (cycle.wants_exact or not self._ranks_checked):
            self._check_ranks_agree(trainer, pl_module)

    def ended_step(self, trainer: Trainer) -> tuple[int, bool]:
        """The step of the current batch and whether its ``end_step`` ran."""
        cycle = self.cycle
        if cycle is None or cycle.step is None:
            return trainer.global_step, False
        return cycle.step, cycle.ended == cycle.step

    def _exact_supported(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        if not pl_module.automatic_optimization:
            self.warn_once(
                "manual",
                "the policy asked for the exact gradient, which needs automatic optimization "
                "(training_step runs the optimizer itself); calibrating without it",
            )
            return False
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            self.warn_once(
                "strategy",
                f"the exact gradient is not available with {type(trainer.strategy).__name__} "
                "(sharded parameters); calibrating without it",
            )
            return False
        return True

    # -- settings agree over ranks -------------------------------------------------
    def settings_digest(self) -> int:
        """A checksum of the codec settings in use: every site's codec and settings in
        the latest step and the policy's per-site settings. Equal on every rank."""
        items: list[tuple[str, ...]] = []
        if self.engine is not None:
            items = sorted(
                (key, rec.codec, rec.settings)
                for key, rec in self.engine.stats.sites.items()
                if rec.codec != "kept"
            )
        items += sorted(self.policy.site_settings().items())
        return zlib.crc32(repr((policy_text(self.policy), items)).encode())

    def _check_ranks_agree(self, trainer: Trainer, pl_module: LightningModule) -> None:
        digest = torch.tensor([self.settings_digest()], dtype=torch.int64, device=pl_module.device)
        gathered = trainer.strategy.all_gather(digest).reshape(-1)
        self._ranks_checked = True
        if bool((gathered != gathered[0]).any()):
            rank_zero_warn(
                "lightning_acgc: codec settings differ between ranks "
                f"(digests {gathered.tolist()}); the policy should calibrate from reduced "
                "statistics"
            )

    # -- before the batch-size search ----------------------------------------------
    def calibration_step(
        self, trainer: Trainer, pl_module: LightningModule, *, replay: bool = False
    ) -> None:
        """One calibration step on the first batch, with no optimizer step and no trace:
        RNG, buffers and gradients are restored, the step counter too.

        With ``replay`` the step runs under the memory budget and the policy's state is
        restored afterwards, so it is the fit's first step played ahead of time: an
        out-of-memory error (or :class:`MemoryBudgetError`) here is one that step would
        raise. Without it the budget is lifted (the search, not this step, finds what
        fits) and the policy keeps what it learned. Nothing once compression stepped
        aside (:meth:`run`)."""
        if not self.active:
            return
        assert self.engine is not None and self.cycle is not None
        engine, cycle = self.engine, self.cycle
        batch = first_train_batch(trainer, pl_module)
        step, budget = self.step, engine.memory_budget
        state = copy.deepcopy(self.policy.state_dict()) if replay else None
        if not replay:
            engine.memory_budget = None
        try:
            wants_exact = cycle.begin(trainer.global_step)
            cycle.loss_scale = 1.0  # (the pass below is not scaled)
            if (wants_exact or self._wants_noise()) and self._exact_supported(trainer, pl_module):
                self._add_noise_estimate(trainer, pl_module, batch, 0)
                if wants_exact:
                    cycle.add_exact_gradient(pl_module, step_loss(trainer, pl_module, batch, 0))
            named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
            with offline(pl_module):
                self._batch = batch
                output = self.run(call_training_step, trainer, pl_module, batch, 0)
                loss = training_loss(output)
                if loss is None or not loss.requires_grad or not named:
                    return
                grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
            previous = [p.grad for _, p in named]
            try:
                for (_, p), grad in zip(named, grads, strict=True):
                    p.grad = grad
                cycle.end(pl_module)
            finally:
                for (_, p), grad in zip(named, previous, strict=True):
                    p.grad = grad
        finally:
            engine.memory_budget = budget
            self.step = step
            self._noise_step = None
            cycle.reset()  # the fit's first step calibrates afresh
            if state is not None:
                self.policy.load_state_dict(state)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(f"lightning_acgc: {message}")
