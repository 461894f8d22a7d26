"""``ActivationCompression``: the Lightning callback that compresses saved activations.

The user's whole effort is one line::

    trainer = Trainer(callbacks=[ActivationCompression()])

What the callback does in one fit:

- **fit start**: builds an :class:`~lightning_acgc.engine.ActivationCompressor` for the
  policy and model, installs its module hooks, calls ``policy.setup(model)``, and makes
  the strategy scope ``training_step`` (below). With ``scale_batch_size`` it then runs
  Lightning's batch-size search (``batch_size.py``).
- **each training step**: ``policy.begin_step`` on the step's first batch; on steps
  where ``policy.needs_exact_gradient`` says so, the uncompressed gradient of the
  step's loss, averaged over ranks and handed to ``policy.set_exact_gradients`` before
  the compressed forward (``training_step`` run once more, engine paused, RNG and
  buffers restored, logging off; with gradient accumulation, summed over the step's
  batches and handed over before the last one's forward); the forward runs
  compressed; after backward, before the optimizer step,
  ``policy.end_step(step, model, reduce)`` with ``reduce`` averaging over ranks; then
  ``acgc/ratio`` (progress bar), ``acgc/saved_mb``, ``acgc/packed_mb`` and
  ``acgc/<metric>`` for each of ``policy.metrics()`` are logged.
- **fit end, exception or teardown**: the strategy is restored, every engine hook is
  removed, ``policy.teardown()``; at fit end rank zero prints the per-site table.

How the hooks are scoped, with any strategy: the saved-tensor hooks are entered around
``Strategy.training_step`` and nowhere else, so validation, test and predict are never
compressed, every forward of a manual-optimization step is, and the hooks stay active
during the trials of Lightning's batch-size tuner, which empties ``trainer.callbacks``.
With a compression strategy (``Trainer(strategy="acgc")``, ``"acgc_ddp"``, ...) the
strategy's own ``training_step`` does it. With a stock Lightning strategy the callback
wraps ``training_step`` on that one strategy instance at fit start and puts the original
back at fit end, on exceptions and in teardown; no class and nothing in torch or
Lightning is patched. Entering the hooks in ``on_train_batch_start`` and leaving them
in ``on_train_batch_end`` was rejected: the hooks would also be active for backward,
the optimizer step and other callbacks, and not at all during tuner trials.
"""

from __future__ import annotations

import dataclasses
import inspect
import zlib
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_acgc._lightning_utils import (
    CompressionScopeMixin,
    StepScope,
    TrainingStepPatch,
    call_training_step,
    exact_gradients,
    first_train_batch,
    make_reduce,
    mean_over_ranks,
    offline,
    training_loss,
)
from lightning_acgc.batch_size import CompressedBatchSizeFinder, parse_memory, static_memory_bytes
from lightning_acgc.engine.compressor import ActivationCompressor
from lightning_acgc.engine.meter import CompressionStats
from lightning_acgc.policies import OffPolicy, Policy, build_policy

__all__ = ["CODEC_POLICY", "DEFAULT_POLICY", "DEFAULT_POLICY_OPTIONS", "ActivationCompression"]

# The default policy and, when no codec is named, its default options: the one place to
# change when another policy becomes the default.
# Without ``policy``: the adaptive AC-GC policy; naming a codec or its options instead
# (``ActivationCompression(codec="quant", bits=2)``) means that codec everywhere.
DEFAULT_POLICY = "acgc"
CODEC_POLICY = "fixed"
DEFAULT_POLICY_OPTIONS: dict[str, dict[str, Any]] = {"fixed": {"codec": "quant", "bits": 4}}
_CODEC_OPTIONS = frozenset({"codec", "bits", "group_size", "error_bound", "relative", "block"})


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def _accumulating(trainer: Trainer) -> bool:
    """Whether the current batch accumulates gradients (no optimizer step after it)."""
    if trainer.accumulate_grad_batches <= 1:
        return False
    should_accumulate = getattr(trainer.fit_loop, "_should_accumulate", None)
    return bool(should_accumulate()) if should_accumulate is not None else False


def _policy_class(name: str) -> type[Policy] | None:
    from lightning_acgc.policies import available_policies, policy_class

    return policy_class(name) if name in available_policies() else None


def _build_policy(
    policy: str | Policy | None,
    calibrate_every: int,
    engine_options: dict[str, Any],
    options: dict[str, Any],
) -> Policy:
    if policy is None:
        policy = CODEC_POLICY if _CODEC_OPTIONS & options.keys() else DEFAULT_POLICY
    if isinstance(policy, Policy):
        if options:
            raise ValueError(
                f"options {sorted(options)} configure a policy by name; a Policy instance "
                "is already configured, so give them to its constructor"
            )
        return policy
    if not isinstance(policy, str):
        raise ValueError(f"policy={policy!r} must be a policy name or a Policy instance")
    cls = _policy_class(policy)
    if cls is None:
        return build_policy(policy)  # raises the registry's ValueError naming the choices
    params = inspect.signature(cls.__init__).parameters
    options = dict(options)
    if "codec" not in options:
        options = {**DEFAULT_POLICY_OPTIONS.get(policy, {}), **options}
    if "calibrate_every" in params:
        options["calibrate_every"] = calibrate_every
    if "config" in params:
        options.update(engine_options)
    return build_policy(policy, **options)


def _codec_text(policy: Policy) -> str:
    """``"codec=quant bits=4"``: the policy's codec and codec options (or ``""``)."""
    parts: list[str] = []
    config = getattr(policy, "config", None)
    if (
        config is not None
        and dataclasses.is_dataclass(config)
        and not isinstance(policy, OffPolicy)
    ):
        parts.append(f"codec={config.codec}")
        parts.extend(f"{k}={v}" for k, v in sorted(config.codec_options.items()))
    return " ".join(parts)


def _policy_text(policy: Policy) -> str:
    """:func:`_codec_text` plus the policy's own options (its constructor's arguments
    kept as attributes of the same name), e.g. ``"acgc codec=bounded gradient_error=0.05"``."""
    parts = [policy.name, _codec_text(policy)]
    for name in inspect.signature(type(policy).__init__).parameters:
        value = getattr(policy, name, None)
        if name not in ("self", "config") and isinstance(value, (bool, int, float, str)):
            parts.append(f"{name}={value}")
    return " ".join(p for p in parts if p)


class ActivationCompression(Callback):
    """Compresses the activations autograd saves in ``training_step``.

    Args:
        policy: a policy name (``"acgc"``, ``"gact"``, ``"division"``, ``"comet"``,
            ``"fixed"``, ``"off"``; see :func:`lightning_acgc.policies.available_policies`)
            or a :class:`~lightning_acgc.policies.Policy` instance. ``None`` (default):
            ``"acgc"``, or ``"fixed"`` when a codec or codec option is given.
            ``"off"`` installs nothing: training is bit-identical to plain Lightning.
        calibrate_every: steps between calibrations, for a policy given by name whose
            constructor takes it.
        log_every_n_steps: log the compression numbers every this many steps.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` for the codecs' kernels.
        min_numel: tensors with fewer elements are kept as they are.
        seed: base seed of the codecs' random numbers (never the global RNG).
        print_table: print the per-site table at fit end (rank zero): ``True`` the
            largest sites, why tensors stayed raw and the total; ``"full"`` every site.
        scale_batch_size: ``"power"``, ``"binsearch"``, a
            :class:`~lightning_acgc.batch_size.CompressedBatchSizeFinder`, or ``None``:
            raise the batch size with Lightning's tuner on fit start, with compression
            active (single process only).
        memory_budget: bytes (int) or text (``"2GB"``, ``"512MiB"``) that live saved
            activations plus parameters, gradients and optimizer state may use; going
            past it raises an out-of-memory error that the tuner recognizes.
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``None``: how the learning rate follows
            the batch size found by ``scale_batch_size``.
        **options: the policy's options: codec and codec options for ``"fixed"``
            (``codec="quant", bits=2``), the error target for calibrating policies.
            Without a codec, the default policy uses ``DEFAULT_POLICY_OPTIONS``.

    Raises:
        ValueError: unknown policy, codec or option, an option with a bad value, or
            ``lr_scaling`` without ``scale_batch_size``; raised here, before training.

    Example:
        >>> import torch
        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> compression = ActivationCompression(
        ...     policy="fixed", codec="quant", bits=4, min_numel=0, print_table=False)
        >>> trainer = Trainer(
        ...     callbacks=[compression], max_steps=2, logger=False, enable_checkpointing=False,
        ...     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        ...     limit_val_batches=0, num_sanity_val_steps=0)
        >>> model = BoringModel()
        >>> model.layer = torch.nn.Sequential(
        ...     torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
        >>> trainer.fit(model)
        >>> compression.stats.sites["layer.1:0"].codec
        'quant'
        >>> float(trainer.callback_metrics["acgc/ratio"]) > 1
        True
        >>> ActivationCompression(codec="quant", bits=3)
        Traceback (most recent call last):
        ...
        ValueError: bits=3 is not allowed; allowed values: [1, 2, 4, 8]
    """

    def __init__(
        self,
        policy: str | Policy | None = None,
        *,
        calibrate_every: int = 100,
        log_every_n_steps: int = 1,
        backend: str = "auto",
        min_numel: int = 1024,
        seed: int = 0,
        print_table: bool | str = True,
        scale_batch_size: str | CompressedBatchSizeFinder | None = None,
        memory_budget: int | str | None = None,
        lr_scaling: str | None = None,
        **options: Any,
    ) -> None:
        _check_int("calibrate_every", calibrate_every, 1)
        _check_int("log_every_n_steps", log_every_n_steps, 1)
        _check_int("min_numel", min_numel, 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed={seed!r} must be an int")
        engine_options = {"backend": backend, "min_numel": min_numel, "seed": seed}
        self.policy = _build_policy(policy, calibrate_every, engine_options, options)
        self.calibrate_every = calibrate_every
        self.log_every_n_steps = log_every_n_steps
        self.min_numel = min_numel
        self.seed = seed
        if print_table not in (True, False, "full"):
            raise ValueError(f"print_table={print_table!r} must be True, False or 'full'")
        self.print_table = print_table
        self.memory_budget = parse_memory(memory_budget)
        self.batch_size_finder = self._make_finder(scale_batch_size, lr_scaling)

        self.engine: ActivationCompressor | None = None
        self._scope: StepScope | None = None
        self._patch: TrainingStepPatch | None = None
        self._strategy: CompressionScopeMixin | None = None
        self._active = False
        self._loaded_step: int | None = None
        self._last_step = 0
        self._begun: int | None = None
        self._ended: int | None = None
        self._exact_wanted = False
        self._exact: dict[str, torch.Tensor] | None = None
        self._ranks_checked = False
        self._search_logged = False
        self._warned: set[str] = set()

    def _make_finder(
        self, scale_batch_size: str | CompressedBatchSizeFinder | None, lr_scaling: str | None
    ) -> CompressedBatchSizeFinder | None:
        if scale_batch_size is None:
            if lr_scaling is not None:
                raise ValueError(
                    f"lr_scaling={lr_scaling!r} applies to a batch-size search; "
                    "set scale_batch_size='binsearch' or 'power' too"
                )
            return None
        if not self.enabled:
            raise ValueError(
                "scale_batch_size needs compression, but policy='off' installs nothing; "
                "use Lightning's BatchSizeFinder for an uncompressed search"
            )
        if isinstance(scale_batch_size, CompressedBatchSizeFinder):
            if lr_scaling is not None:
                if scale_batch_size.lr_scaling not in (None, lr_scaling):
                    raise ValueError(
                        f"lr_scaling={lr_scaling!r} differs from the finder's "
                        f"{scale_batch_size.lr_scaling!r}; give it in one place"
                    )
                scale_batch_size.lr_scaling = lr_scaling
            finder = scale_batch_size
        elif isinstance(scale_batch_size, str):
            finder = CompressedBatchSizeFinder(scale_batch_size, lr_scaling=lr_scaling)
        else:
            raise ValueError(
                f"scale_batch_size={scale_batch_size!r} must be 'power', 'binsearch', "
                "a CompressedBatchSizeFinder or None"
            )
        finder._owned = True
        return finder

    # -- public read-outs --------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False for the ``off`` policy: nothing is installed."""
        return not isinstance(self.policy, OffPolicy)

    @property
    def stats(self) -> CompressionStats | None:
        """The engine's counters of the latest step (kept after fit)."""
        return self.engine.stats if self.engine is not None else None

    def describe(self) -> str:
        """Short text of the policy and its settings."""
        return _policy_text(self.policy)

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
        return zlib.crc32(repr((self.describe(), items)).encode())

    def summary(self) -> str:
        """The per-site table of the latest step, then the policy's site settings."""
        if self.engine is None:
            return "lightning_acgc: no training step ran"
        table = self.engine.stats.table(full=self.print_table == "full")
        lines = [f"lightning_acgc: {self.describe()} (latest step)", table]
        settings = self.policy.site_settings()
        if settings:
            lines.append("policy settings:")
            lines.extend(f"  {key}: {value}" for key, value in settings.items())
        return "\n".join(lines)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy.name, codec=_codec_text(self.policy))

    # -- setup and cleanup -------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or not self.enabled:
            return
        others = [
            cb
            for cb in trainer.callbacks
            if isinstance(cb, ActivationCompression) and cb is not self and cb.enabled
        ]
        if others:
            raise MisconfigurationException(
                "one ActivationCompression per Trainer: found another one "
                f"({others[0].describe()}); keep one, or set policy='off' on the others"
            )
        plain = [
            cb
            for cb in trainer.callbacks
            if isinstance(cb, BatchSizeFinder) and not isinstance(cb, CompressedBatchSizeFinder)
        ]
        if plain:
            rank_zero_warn(
                "BatchSizeFinder runs before ActivationCompression starts, so its trials are "
                "not compressed; use ActivationCompression(scale_batch_size='binsearch') instead"
            )
        if self.batch_size_finder is not None:
            self.batch_size_finder.setup(trainer, pl_module, stage)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled:
            return
        self._start(trainer, pl_module)
        if self.batch_size_finder is not None:
            self._search(trainer, pl_module)

    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        config = getattr(self.policy, "config", None)
        budget_base = 0
        if self.memory_budget is not None:
            budget_base = static_memory_bytes(pl_module, trainer.optimizers)
        engine = ActivationCompressor(
            self.policy,
            model=pl_module,
            min_numel=self.min_numel,
            seed=self.seed,
            compress_masks=getattr(config, "compress_masks", True),
            strict=getattr(config, "strict", False),
            memory_budget=self.memory_budget,
            budget_base=budget_base,
        )
        engine.install()
        scope = StepScope(engine, step=self._loaded_step or 0)
        strategy = trainer.strategy
        try:
            self.policy.setup(pl_module)
            if isinstance(strategy, CompressionScopeMixin):
                strategy.attach_compression(scope)
                self._strategy = strategy
            else:
                self._patch = TrainingStepPatch(strategy, scope)
        except BaseException:
            engine.remove()
            raise
        self.engine, self._scope, self._active = engine, scope, True
        self._begun = self._ended = None
        self._exact, self._exact_wanted = None, False
        self._ranks_checked = self._search_logged = False

    def _stop(self) -> None:
        """Undo everything :meth:`_start` did (idempotent; also after exceptions)."""
        if self._patch is not None:
            self._patch.restore()
            self._patch = None
        if self._strategy is not None:
            self._strategy.detach_compression()
            self._strategy = None
        if self.engine is not None and self.engine.installed:
            self.engine.remove()
        if self._active:
            self._active = False
            if self._scope is not None:
                self._last_step = self._scope.step
            self._loaded_step = None
            self._exact = None
            self.policy.teardown()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        try:
            engine = self.engine
            if self._active and self.print_table and engine is not None and engine.stats.sites:
                rank_zero_info(self.summary())
        finally:
            self._stop()

    @override
    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._stop()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._stop()

    # -- one training step -------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        step = trainer.global_step
        if step != self._begun:
            self._begun = step
            self._exact = None
            self.policy.begin_step(step)
            self._exact_wanted = bool(self.policy.needs_exact_gradient(step))
        if self._exact_wanted:
            self._add_exact_gradient(trainer, pl_module, batch, batch_idx)

    def _exact_supported(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        if not pl_module.automatic_optimization:
            self._warn_once(
                "manual",
                "the policy asked for the exact gradient, which needs automatic optimization "
                "(training_step runs the optimizer itself); calibrating without it",
            )
            return False
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            self._warn_once(
                "strategy",
                f"the exact gradient is not available with {type(trainer.strategy).__name__} "
                "(sharded parameters); calibrating without it",
            )
            return False
        return True

    def _add_exact_gradient(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch is None or not self._exact_supported(trainer, pl_module):
            return
        assert self.engine is not None
        scale = 1.0 / trainer.accumulate_grad_batches
        grads = exact_gradients(trainer, pl_module, self.engine, batch, batch_idx, scale)
        if grads is None:
            return
        if self._exact is None:
            self._exact = grads
        else:
            for name, grad in grads.items():
                self._exact[name] = self._exact[name] + grad
        # Handed over before the forward, as the policy protocol says; with gradient
        # accumulation, before the forward of the step's last batch, with the whole sum.
        if not _accumulating(trainer):
            self._hand_exact_gradients(trainer, self._exact)
            self._exact = None

    def _hand_exact_gradients(self, trainer: Trainer, grads: dict[str, torch.Tensor]) -> None:
        """``policy.set_exact_gradients`` with the gradient averaged over ranks (and the
        ``reduce`` function too, for policies that take it)."""
        reduce = make_reduce(trainer)
        grads = mean_over_ranks(grads, reduce, trainer.world_size)
        if "reduce" in inspect.signature(self.policy.set_exact_gradients).parameters:
            self.policy.set_exact_gradients(grads, reduce=reduce)  # type: ignore[call-arg]
        else:
            self.policy.set_exact_gradients(grads)

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._active or self._begun is None or self._ended == self._begun:
            return
        step = self._begun
        self._exact = None
        self.policy.end_step(step, pl_module, make_reduce(trainer))
        self._ended = step
        if trainer.world_size > 1 and (self._exact_wanted or not self._ranks_checked):
            self._check_ranks_agree(trainer, pl_module)

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

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._active or self.engine is None:
            return
        step = self._begun if self._begun is not None else trainer.global_step
        if step % self.log_every_n_steps:
            return
        stats = self.engine.stats
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("acgc/ratio", stats.ratio, prog_bar=True, **log)
        pl_module.log("acgc/saved_mb", stats.saved_bytes / 2**20, **log)
        pl_module.log("acgc/packed_mb", stats.packed_bytes / 2**20, **log)
        if self._ended == step:
            for key, value in self.policy.metrics().items():
                pl_module.log(f"acgc/{key}", float(value), **log)
        if not self._search_logged and self.batch_size_finder is not None:
            self._search_logged = True
            for key, value in self.batch_size_finder.metrics().items():
                pl_module.log(key, value, **log)

    # -- batch-size search ---------------------------------------------------------
    def _search(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self.batch_size_finder is not None and self.engine is not None
        if trainer.fast_dev_run:
            rank_zero_info("lightning_acgc: fast_dev_run, skipping the batch-size search")
            return
        if pl_module.automatic_optimization:
            self._calibration_step(trainer, pl_module)
        else:
            self._warn_once(
                "search-manual",
                "with manual optimization the batch-size search runs before any calibration",
            )
        self.batch_size_finder.search(trainer, pl_module, self.engine)

    def _calibration_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """One calibration step on the first batch, with no optimizer step and no trace:
        RNG, buffers and gradients are restored, the step counter too."""
        assert self.engine is not None and self._scope is not None
        engine, scope = self.engine, self._scope
        batch = first_train_batch(trainer, pl_module)
        step, scope_step, budget = trainer.global_step, scope.step, engine.memory_budget
        reduce = make_reduce(trainer)
        engine.memory_budget = None  # the search, not this step, finds what fits
        try:
            self.policy.begin_step(step)
            if self.policy.needs_exact_gradient(step) and self._exact_supported(trainer, pl_module):
                exact = exact_gradients(trainer, pl_module, engine, batch, 0)
                if exact is not None:
                    self._hand_exact_gradients(trainer, exact)
            named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
            with offline(pl_module):
                output = scope.run(call_training_step, trainer, pl_module, batch, 0)
                loss = training_loss(output)
                if loss is None or not loss.requires_grad or not named:
                    return
                grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
            previous = [p.grad for _, p in named]
            try:
                for (_, p), grad in zip(named, grads, strict=True):
                    p.grad = grad
                self.policy.end_step(step, pl_module, reduce)
            finally:
                for (_, p), grad in zip(named, previous, strict=True):
                    p.grad = grad
        finally:
            engine.memory_budget = budget
            scope.step = scope_step

    # -- checkpointing -------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        if self._active and self._scope is not None:
            step = self._scope.step
        elif self._loaded_step is not None:
            step = self._loaded_step
        else:
            step = self._last_step
        return {
            "policy_name": self.policy.name,
            "policy": self.policy.state_dict(),
            "seed": self.seed,
            "step": step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.enabled or not state_dict:
            return
        name = state_dict.get("policy_name")
        if name != self.policy.name:
            rank_zero_warn(
                f"lightning_acgc: the checkpoint was written by policy {name!r}, this run uses "
                f"{self.policy.name!r}; starting the policy afresh"
            )
        else:
            self.policy.load_state_dict(state_dict.get("policy", {}))
        seed = state_dict.get("seed", self.seed)
        if seed != self.seed:
            rank_zero_info(
                f"lightning_acgc: continuing with the checkpoint's seed {seed} (not {self.seed})"
            )
            self.seed = seed
            if self.engine is not None:
                self.engine.seed = seed
        step = int(state_dict.get("step", 0))
        if self._active and self._scope is not None:
            self._scope.step = step
        else:
            self._loaded_step = step

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(f"lightning_acgc: {message}")
