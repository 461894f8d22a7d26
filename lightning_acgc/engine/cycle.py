"""The policy's calibration cycle, written once: begin, exact gradient, compressed pass,
end. :func:`~lightning_acgc.engine.compressed_step` (plain PyTorch) and the Lightning
adapter both drive a :class:`CalibrationCycle`. No Lightning import here."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from lightning_acgc.engine.compressor import ActivationCompressor, MemoryBudgetError
from lightning_acgc.engine.last_batch import LastBatch, held_gradients
from lightning_acgc.engine.policy import Policy, Reduce
from lightning_acgc.kernels.common.sums import dense

__all__ = ["CalibrationCycle", "exact_gradients", "mean_over_ranks", "no_reduce", "no_side_effects"]


def no_reduce(t: torch.Tensor) -> torch.Tensor:
    """The ``reduce`` of a single process."""
    return t


@contextlib.contextmanager
def no_side_effects(model: nn.Module) -> Iterator[None]:
    """Undo what an extra forward of ``model`` changes: the random states of the CPU and
    of the CUDA devices holding parameters are restored (dropout draws the same masks
    again) and so are the buffers (BatchNorm running statistics)."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    buffers = [(b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"]
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)


def exact_gradients(
    engine: ActivationCompressor,
    model: nn.Module,
    compute_loss: Callable[[], torch.Tensor | None],
    scale: float = 1.0,
    compressed: bool = False,
) -> dict[str, torch.Tensor] | None:
    """The uncompressed gradient of ``scale * compute_loss()`` by parameter name, leaving
    no trace: ``.grad`` untouched, random state and buffers restored
    (:func:`no_side_effects`), so the compressed pass that follows sees the same dropout
    masks and statistics. A parameter the loss does not reach gets zeros (every rank
    has the same names). ``None`` when there is no differentiable loss. With the
    engine's ``offload_exact`` the pass's saved tensors wait in host memory
    (``torch.autograd.graph.save_on_cpu``). With ``compressed``, the pass runs under the
    engine's hooks instead (a policy's probe: what its ``codec_for`` chooses then)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        return None
    offload = contextlib.nullcontext()
    if getattr(engine, "offload_exact", False) and not compressed:
        offload = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    hooks = engine.scope() if compressed else engine.paused()
    with no_side_effects(model), hooks, offload:
        loss = compute_loss()
        if loss is None or not loss.requires_grad:
            return None
        grads = torch.autograd.grad(
            loss * scale if scale != 1.0 else loss, [p for _, p in named], allow_unused=True
        )
    return {  # (a sparse gradient, an Embedding's with sparse=True, made dense)
        n: (dense(g.detach()) if g is not None else torch.zeros_like(p))
        for (n, p), g in zip(named, grads, strict=True)
    }


def mean_over_ranks(
    grads: dict[str, torch.Tensor], reduce: Reduce, world_size: int
) -> dict[str, torch.Tensor]:
    """``grads`` averaged over ranks in one collective (flattened and split again)."""
    if world_size <= 1 or not grads:
        return grads
    names = list(grads)
    flat = reduce(torch.cat([grads[n].reshape(-1).float() for n in names]))
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for n in names:
        g = grads[n]
        out[n] = flat[offset : offset + g.numel()].view_as(g).to(g.dtype)
        offset += g.numel()
    return out


class CalibrationCycle:
    """One policy's calibration cycle over the steps of a fit.

    Per step: :meth:`begin` (``policy.begin_step``; whether the policy wants the exact
    gradient), :meth:`add_exact_gradient` on each of the step's batches when it does
    (summed; handed to ``policy.set_exact_gradients``, averaged over ranks, with the
    last batch, before its compressed forward; the policy's ``exact_pass`` around each,
    where it has one), :meth:`add_probes`, the compressed forward and backward (the
    caller's), then :meth:`end` (``policy.end_step``; after more than one batch, first
    ``policy.set_step_gradients`` with the last batch's gradient read as the step's,
    :class:`~lightning_acgc.engine.last_batch.LastBatch`) before the optimizer step.

    Args:
        engine: the installed engine whose policy is calibrated.
        reduce: averages a tensor over data-parallel ranks.
        world_size: number of ranks (1: nothing is averaged).

    ``loss_scale``: the factor the step's own backward scales its loss by (fp16 training's
    GradScaler; the Lightning adapter sets it each step). The cycle's passes scale their
    loss by it too and divide their gradients by it: an unscaled fp16 backward loses the
    small output gradients the scaled one keeps (below 6e-8 they are 0), and read against
    the step's gradient that loss was counted as the codecs' error (κ ran to 800 on a
    small-loss MLP, nothing compressed).

    Example:
        >>> from lightning_acgc.engine.settings import EngineSettings
        >>> from lightning_acgc.policies import build_policy
        >>> model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
        >>> engine = ActivationCompressor(build_policy("acgc"), model=model)
        >>> cycle = CalibrationCycle(engine)
        >>> cycle.begin(0)
        True
        >>> grads = cycle.add_exact_gradient(model, lambda: model(torch.ones(2, 8)).sum())
        >>> sorted(grads) == sorted(n for n, _ in model.named_parameters())
        True
    """

    def __init__(
        self, engine: ActivationCompressor, reduce: Reduce = no_reduce, world_size: int = 1
    ) -> None:
        self.engine = engine
        self.reduce = reduce
        self.world_size = world_size
        self.step: int | None = None  # the step begun
        self.ended: int | None = None  # the step whose end_step ran
        self.wants_exact = False
        self._exact: dict[str, torch.Tensor] | None = None
        self.loss_scale = 1.0
        self._batches = 0  # batches whose exact gradient the step's sum holds
        self._last: LastBatch | None = None  # after an accumulated sum: for the probes

    def _gradients(
        self,
        model: nn.Module,
        compute_loss: Callable[[], torch.Tensor | None],
        scale: float = 1.0,
        compressed: bool = False,
    ) -> dict[str, torch.Tensor] | None:
        """:func:`exact_gradients` at ``scale`` times the step's ``loss_scale``, unscaled."""
        factor = self.loss_scale
        grads = exact_gradients(self.engine, model, compute_loss, scale * factor, compressed)
        if grads is None or factor == 1.0:
            return grads
        return {n: g / factor for n, g in grads.items()}

    @property
    def policy(self) -> Policy:
        return self.engine.policy

    def begin(self, step: int) -> bool:
        """``policy.begin_step(step)`` once per step; whether it wants the exact gradient."""
        if step != self.step:
            self.step = step
            self._exact, self._batches, self._last = None, 0, None
            self.policy.begin_step(step)
            self.wants_exact = bool(self.policy.needs_exact_gradient(step))
        return self.wants_exact

    def add_exact_gradient(
        self,
        model: nn.Module,
        compute_loss: Callable[[], torch.Tensor | None],
        scale: float = 1.0,
        last: bool = True,
    ) -> dict[str, torch.Tensor] | None:
        """Add this batch's exact gradient (``scale`` times it) to the step's sum; with
        ``last``, hand the sum over ranks' mean to the policy (a sum of more than one
        batch is kept with the last one's, for :meth:`add_probes`). Returns this batch's."""
        reading = getattr(self.policy, "exact_pass", None)  # its statistics read this pass
        with reading(self.loss_scale) if reading is not None else contextlib.nullcontext():
            grads = self._gradients(model, compute_loss, scale)
        if grads is None:
            return None
        self._batches += 1
        if self._exact is None:
            self._exact = dict(grads)
        else:
            for name, grad in grads.items():
                self._exact[name] = self._exact[name] + grad
        if last:
            total = mean_over_ranks(self._exact, self.reduce, self.world_size)
            self._exact = None
            if self._batches > 1:  # (.grad holds the earlier batches' compressed sum)
                own, before = (
                    mean_over_ranks(g, self.reduce, self.world_size)
                    for g in (grads, held_gradients(model))
                )
                if getattr(self.engine, "offload_exact", False):  # (in host memory, as the passes)
                    own, before = ({n: g.cpu() for n, g in t.items()} for t in (own, before))
                self._last = LastBatch(total, own, self._batches, scale, before)
            self.policy.set_exact_gradients(total, reduce=self.reduce)
        return grads

    def add_noise_estimate(
        self,
        model: nn.Module,
        loss_halves: tuple[Callable[[], torch.Tensor | None], Callable[[], torch.Tensor | None]],
        scale: float = 1.0,
    ) -> bool:
        """For a policy with a noise-relative budget that wants it this step
        (``needs_noise_estimate``): the exact gradients of the batch's two halves (each
        times ``scale``), averaged over ranks, handed to ``policy.set_noise_gradients``.
        Whether they were. With k batches accumulated into a step, one batch's halves
        with ``scale`` = 1/√k measure the step's noise (its variance is one batch's / k)."""
        wants = getattr(self.policy, "needs_noise_estimate", None)
        if wants is None or self.step is None or not wants(self.step):
            return False
        halves = [self._gradients(model, f, scale) for f in loss_halves]
        if halves[0] is None or halves[1] is None:
            return False
        g1, g2 = (mean_over_ranks(g, self.reduce, self.world_size) for g in halves)
        self.policy.set_noise_gradients(g1, g2)  # type: ignore[attr-defined]
        return True

    def add_probes(self, model: nn.Module, compute_loss: Callable[[], torch.Tensor | None]) -> int:
        """For a policy that measures its sensitivities by probes (``probe_classes``, after
        the exact gradient was handed over): one more forward and backward of the batch
        per class it names, under ``begin_probe`` (its ``codec_for`` then compresses that
        class only), the gradient averaged over ranks handed to ``end_probe``; then
        ``probes_done`` (the policy settles the step's settings with them). Leaves no
        trace (:func:`no_side_effects`; the engine's step is begun again before each probe
        and after the last). After a step's exact gradient summed over accumulated
        batches, the probes run on the last of them, read as the step's
        (:class:`LastBatch`). Returns the number of probes."""
        classes = getattr(self.policy, "probe_classes", None)
        if classes is None or self.step is None:
            return 0
        todo = list(classes(self.step))
        last = self._last
        for cls in todo:
            self.engine.new_step(self.engine.step)  # sites numbered as in the step's pass
            self.policy.begin_probe(cls)  # type: ignore[attr-defined]
            grads = None
            try:
                scale = 1.0 if last is None else last.scale
                grads = self._gradients(model, compute_loss, scale, compressed=True)
            except (MemoryBudgetError, torch.OutOfMemoryError):
                # A probe keeps every other class's tensors as they are: at a batch raised
                # into the memory that compression freed it may not fit, where the step's
                # own (compressed) pass does. The rest of the probes are skipped this
                # calibration; the model's factors stand for them.
                warnings.warn(
                    "lightning_acgc: a calibration probe did not fit in memory at this "
                    "batch size (it keeps most saved tensors uncompressed); its probes "
                    "were skipped and the policy's model guesses those sensitivities",
                    RuntimeWarning,
                    stacklevel=2,
                )
                break
            finally:
                if grads is not None:
                    grads = mean_over_ranks(grads, self.reduce, self.world_size)
                    grads = grads if last is None else last.as_step(grads)
                self.policy.end_probe(cls, grads)  # type: ignore[attr-defined]
        if todo:
            self.engine.new_step(self.engine.step)  # the probes' records are not the step's
            self.policy.probes_done()  # type: ignore[attr-defined]
        return len(todo)

    def reset(self) -> None:
        """Forget the step begun: the next :meth:`begin` calls ``begin_step`` again."""
        self.step = self.ended = None
        self.wants_exact = False
        self._exact, self._batches, self._last = None, 0, None

    def end(self, model: nn.Module) -> bool:
        """``policy.end_step`` for the step begun (once), after ``set_loss_scale`` (the
        step's ``loss_scale``, where the policy has it); whether it ran now."""
        if self.step is None or self.ended == self.step:
            return False
        last, self._exact, self._last = self._last, None, None
        hand_over = getattr(self.policy, "set_step_gradients", None)
        if last is not None and hand_over is not None:  # accumulated: read on its last batch
            hand_over(last.compressed_as_step(model))
        set_scale = getattr(self.policy, "set_loss_scale", None)
        if set_scale is not None:
            set_scale(self.loss_scale)
        self.policy.end_step(self.step, model, self.reduce)
        self.ended = self.step
        return True
