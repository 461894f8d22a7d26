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
  compressed; after backward, before the optimizer step (accumulated: first
  ``policy.set_step_gradients``, the last batch's gradient read as the step's),
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
Lightning is patched. (Hooks entered in ``on_train_batch_start`` would also be active
for backward, the optimizer step and other callbacks, and not during tuner trials.)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_acgc.checkpointing import CheckpointedModules, check_patterns
from lightning_acgc.engine.meter import CompressionStats
from lightning_acgc.engine.settings import EngineSettings
from lightning_acgc.lightning.batch_size import CompressedBatchSizeFinder
from lightning_acgc.lightning.driver import CalibrationDriver
from lightning_acgc.lightning.memory import parse_memory
from lightning_acgc.lightning.options import codec_text, make_finder, make_policy, policy_text
from lightning_acgc.policies import OffPolicy, Policy

__all__ = ["ActivationCompression"]


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


class ActivationCompression(Callback):
    """Compresses the activations autograd saves in ``training_step``.

    Args:
        policy: a policy name (``"acgc"``, ``"gact"``, ``"division"``, ``"comet"``,
            ``"fixed"``, ``"off"``; see :func:`lightning_acgc.policies.available_policies`)
            or a :class:`~lightning_acgc.policies.Policy` instance. ``None`` (default):
            ``"acgc"``, or ``"fixed"`` when ``codec`` or an option of fixed's default
            codec (``bits``, ``group_size``) is given.
            ``"off"`` installs nothing: training is bit-identical to plain Lightning.
        log_every_n_steps: log the compression numbers every this many steps.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` for the codecs' kernels.
        min_numel: tensors with fewer elements are not encoded alone.
        coalesce_min_numel: floating tensors under ``min_numel`` with at least this many
            elements are encoded together in chunks (``None``: kept as they are).
        seed: base seed of the codecs' random numbers (never the global RNG).
        compress_masks: dropout masks (bool tensors, and two-valued float tensors without
            autograd history) go to the lossless 1-bit ``mask`` codec.
        strict: re-raise codec errors instead of keeping the tensor uncompressed.
        compress_loss: compress the loss's tensors, saved outside every module, with the
            policy's codecs (float16 by default: :class:`~lightning_acgc.engine.EngineSettings`).
        low_peak: a tensor remade at unpack from others does not keep them decoded until
            their own unpacks (they are decoded again there): a lower step peak for more
            decoding time (the same values; :class:`~lightning_acgc.engine.EngineSettings`).
        remake_products: Linear and convolution outputs the next op saves are remade at
            unpack from the product's input (acgc); ``False`` stores them through the
            policy's codecs instead: less time, more memory
            (:class:`~lightning_acgc.engine.EngineSettings`).
        print_table: print the per-site table at fit end (rank zero): ``True`` the
            largest sites, why tensors stayed raw and the total; ``"full"`` every site.
        scale_batch_size: ``"power"``, ``"binsearch"``, a
            :class:`~lightning_acgc.lightning.batch_size.CompressedBatchSizeFinder`, or ``None``:
            raise the batch size with Lightning's tuner on fit start, with compression
            active (single process only).
        memory_budget: bytes (int) or text (``"2GB"``, ``"512MiB"``) that live saved
            activations plus parameters, gradients and optimizer state may use; going
            past it raises an out-of-memory error that the tuner recognizes.
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``None``: how the learning rate follows
            the batch size found by ``scale_batch_size``.
        checkpoint_modules: module class names (``"BertLayer"``) or qualified names
            (``fnmatch`` wildcards) run under ``torch.utils.checkpoint`` during the fit;
            compression then takes what autograd still saves, each block's input
            included (:class:`~lightning_acgc.checkpointing.CheckpointedModules`).
        **options: the policy's options, routed by what the policy declares (see
            :func:`lightning_acgc.policies.build_policy`): codec and codec options for
            ``"fixed"`` (``codec="quant", bits=2``); the error target,
            ``calibrate_every`` and the like for calibrating policies. An option the
            policy does not take is an error naming the policy and its options; one
            set to ``None`` is left out (its default).
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
        log_every_n_steps: int = 1,
        backend: str = "auto",
        min_numel: int = 1024,
        coalesce_min_numel: int | None = 64,
        seed: int = 0,
        compress_masks: bool = True,
        strict: bool = False,
        compress_loss: bool = False,
        low_peak: bool = False,
        remake_products: bool = True,
        print_table: bool | str = True,
        scale_batch_size: str | CompressedBatchSizeFinder | None = None,
        memory_budget: int | str | None = None,
        lr_scaling: str | None = None,
        checkpoint_modules: str | Sequence[str] | None = None,
        **options: Any,
    ) -> None:
        _check_int("log_every_n_steps", log_every_n_steps, 1)
        self.policy = make_policy(policy, backend, options)
        patterns = check_patterns(checkpoint_modules)
        if patterns and not self.enabled:
            raise ValueError("checkpoint_modules needs compression; policy='off' installs nothing")
        self.log_every_n_steps = log_every_n_steps
        if print_table not in (True, False, "full"):
            raise ValueError(f"print_table={print_table!r} must be True, False or 'full'")
        self.print_table = print_table
        self.batch_size_finder = make_finder(scale_batch_size, lr_scaling, self.enabled)
        first = (min_numel, seed, bool(compress_masks), bool(strict), coalesce_min_numel)
        settings = EngineSettings(
            *first,
            compress_loss=bool(compress_loss),
            low_peak=bool(low_peak),
            remake_products=bool(remake_products),
        )
        blocks = CheckpointedModules(patterns) if patterns else None
        self._driver = CalibrationDriver(self.policy, settings, parse_memory(memory_budget), blocks)
        self._search_logged = False

    # -- public read-outs --------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False for the ``off`` policy: nothing is installed."""
        return not isinstance(self.policy, OffPolicy)

    @property
    def settings(self) -> EngineSettings:
        """The engine's settings (the seed follows a resumed checkpoint)."""
        return self._driver.settings

    @property
    def memory_budget(self) -> int | None:
        return self._driver.memory_budget

    @property
    def engine(self) -> Any:
        """The engine of the running or latest fit (``None`` before the first)."""
        return self._driver.engine

    @property
    def stats(self) -> CompressionStats | None:
        """The engine's counters of the latest step (kept after fit)."""
        return self.engine.stats if self.engine is not None else None

    def describe(self) -> str:
        """Short text of the policy and its settings."""
        return policy_text(self.policy)

    def settings_digest(self) -> int:
        """A checksum of the codec settings in use, equal on every rank."""
        return self._driver.settings_digest()

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
        return self._generate_state_key(policy=self.policy.name, codec=codec_text(self.policy))

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
        self._driver.start(trainer, pl_module)
        self._search_logged = False

    def _stop(self) -> None:
        """Undo everything :meth:`_start` did (idempotent; also after exceptions)."""
        self._driver.stop()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        try:
            stats = self.stats if self._driver.active else None
            if self.print_table and stats is not None and stats.sites:
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
        self._driver.batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._driver.before_optimizer_step(trainer, pl_module)

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._driver.active or self.engine is None:
            return
        step, ended = self._driver.ended_step(trainer)
        if step % self.log_every_n_steps:
            return
        stats = self.engine.stats
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        if stats.saved_bytes:  # (nothing saved: a step whose training_step returned None)
            pl_module.log("acgc/ratio", stats.ratio, prog_bar=True, **log)
            pl_module.log("acgc/saved_mb", stats.saved_bytes / 2**20, **log)
            pl_module.log("acgc/packed_mb", stats.packed_bytes / 2**20, **log)
        if ended:
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
        driver, first_step = self._driver, None
        if pl_module.automatic_optimization:
            driver.calibration_step(trainer, pl_module)
            first_step = functools.partial(driver.calibration_step, trainer, pl_module, replay=True)
        else:
            driver.warn_once(
                "search-manual",
                "with manual optimization the batch-size search runs before any calibration",
            )
        if driver.active:  # else training_step refused the hooks (driver.run): no search
            self.batch_size_finder.search(trainer, pl_module, self.engine, first_step)

    # -- checkpointing -------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        return {
            "policy_name": self.policy.name,
            "policy": self.policy.state_dict(),
            "seed": self.settings.seed,
            "step": self._driver.step,
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
        seed = state_dict.get("seed", self.settings.seed)
        if seed != self.settings.seed:
            rank_zero_info(
                "lightning_acgc: continuing with the checkpoint's seed "
                f"{seed} (not {self.settings.seed})"
            )
        self._driver.resume(int(state_dict.get("step", 0)), seed)
