"""What a policy offers the engine (a codec per site) and the adapter (a calibration cycle).

The Lightning adapter drives a policy through one training step like this::

    policy.setup(model)                       # fit start
    policy.begin_step(step)                   # before the step's forward
    if policy.needs_exact_gradient(step):     # calibration steps only
        policy.set_exact_gradients(grads, reduce)  # one uncompressed backward, by name
    ... forward under the engine: policy.codec_for(site, x) per saved tensor ...
    ... backward (gradients in p.grad) ...
    policy.set_step_gradients(grads)          # accumulated steps with an exact gradient
    policy.set_loss_scale(scale)              # the step's loss scale (fp16's GradScaler)
    policy.end_step(step, model, reduce)      # before optimizer.step
    log(policy.metrics())
    policy.teardown()                         # fit end, also after an exception

Everything here is plain Python/torch: policies are unit-tested without a Trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.spec import describe_codec
from lightning_acgc.engine.policy import Reduce
from lightning_acgc.engine.sites import SiteInfo

if TYPE_CHECKING:
    from lightning_acgc.engine.compressor import ActivationCompressor

__all__ = ["Policy", "Reduce"]


class Policy:
    """Base class: no calibration; subclasses override :meth:`codec_for` at least.

    What a subclass declares routes the flat keyword options of
    :func:`~lightning_acgc.policies.build_policy` (and of ``ActivationCompression``):

    - ``options``: the names of its own constructor options.
    - ``codecs``: the codecs it accepts as ``codec=`` (the first is its default), ``None``
      for any registered codec, ``()`` for none; the chosen one reaches the constructor
      as ``config``, a :class:`~lightning_acgc.codecs.CodecSpec`.
    - ``takes_codec_options``: the user sets the chosen codec's own options (``bits=2``);
      otherwise the policy sets them per site and rejects them.
    """

    name: ClassVar[str] = "base"
    options: ClassVar[tuple[str, ...]] = ()
    codecs: ClassVar[tuple[str, ...] | None] = ()
    takes_codec_options: ClassVar[bool] = False
    engine: ActivationCompressor | None = None

    def attach(self, engine: ActivationCompressor) -> None:
        """Called by the :class:`ActivationCompressor` that uses this policy; policies read
        the step's site records from ``engine.stats``."""
        self.engine = engine

    def setup(self, model: nn.Module) -> None:
        """Called once on fit start with the model being trained."""

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        """The codec for ``x`` saved at ``site``; ``None`` keeps ``x`` as it is."""
        raise NotImplementedError

    def describe(self, codec: Codec) -> str:
        """Short text of a codec's settings for tables and logs."""
        return describe_codec(codec)

    def begin_step(self, step: int) -> None:
        """Called before the forward of global step ``step``."""

    def needs_exact_gradient(self, step: int) -> bool:
        """Whether the adapter should compute the uncompressed gradient this step."""
        return False

    def set_exact_gradients(
        self, grads: dict[str, torch.Tensor], reduce: Reduce | None = None
    ) -> None:
        """The uncompressed gradient of this step's loss, by parameter name, before the
        step's compressed forward. With gradient accumulation the adapter sums it over
        the step's micro-batches and calls this once, before the last one's forward.
        ``reduce`` averages statistics over ranks (``None``: one process)."""

    def set_step_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        """With gradient accumulation, on a step that had its exact gradient: the step's
        compressed gradient as :meth:`end_step` should read it in place of ``p.grad``
        (the last batch's, the only one compressed under this step's settings, read as
        the step's: :class:`~lightning_acgc.engine.last_batch.LastBatch`), by name,
        averaged over ranks. Called just before :meth:`end_step`."""

    def set_loss_scale(self, scale: float) -> None:
        """The factor the step's own backward scaled its loss by (fp16's GradScaler; 1
        otherwise): what the policy read on that pass is read divided by it. Called just
        before :meth:`end_step`."""

    def end_step(self, step: int, model: nn.Module, reduce: Reduce) -> None:
        """Called after backward (gradients in ``p.grad``) and before the optimizer step."""

    def metrics(self) -> dict[str, float]:
        """Numbers to log after the step (e.g. ``{"grad_error": 0.03}``)."""
        return {}

    def site_settings(self) -> dict[str, str]:
        """Current per-site settings (site key -> text) for logs and tables."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (resume from a checkpoint)."""

    def teardown(self) -> None:
        """Called on fit end, also after an exception."""
