"""What the benchmarks share: the machine, the recipes' models and batches, and the
configurations compared (plain, ``torch.utils.checkpoint`` per block, each policy)."""

from __future__ import annotations

import copy
import functools
import glob
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F

from benchmarks._cases import CASES, DEFAULT_CASES, generated_batch, sparse_adjacency
from benchmarks._machine import (
    add_common_arguments,
    emit,
    machine,
    progress,
    resolve_device,
    setup_threads,
    synchronize,
)
from lightning_acgc import (
    ActivationCompressor,
    CheckpointedModules,
    EngineSettings,
    build_policy,
    compressed_step,
)
from lightning_acgc.engine.meter import CompressionStats
from lightning_acgc.policies import OffPolicy, Policy

__all__ = [
    "CALIBRATION_STEPS",
    "CASES",
    "CONFIGS",
    "DEFAULT_CASES",
    "MEASURED_STEP",
    "MODELS",
    "POLICIES",
    "SIZES",
    "WITH_CHECKPOINTING",
    "WITH_SETTINGS",
    "Recipe",
    "Runner",
    "add_common_arguments",
    "build_case",
    "build_recipe",
    "count_saved",
    "emit",
    "machine",
    "make_runner",
    "progress",
    "resolve_device",
    "setup_threads",
    "synchronize",
    "timed_step",
]

MODELS = ("resnet", "bert", "gnn")

# Hydra overrides of each recipe's offline default (configs/): "full" is the default
# itself, "quick" shrinks it for a few minutes on 2 CPU cores.
SIZES: dict[str, dict[str, list[str]]] = {
    "quick": {
        "resnet": ["model=resnet", "model.width=0.125", "data.batch_size=32"],
        "bert": ["model=bert", "data.batch_size=32", "data.num_samples=512"],
        "gnn": ["model=gnn", "data.num_nodes=2000"],
    },
    "full": {"resnet": ["model=resnet"], "bert": ["model=bert"], "gnn": ["model=gnn"]},
}

# Compressed configurations: name -> (registered policy, options of build_policy).
POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "acgc": ("acgc", {}),
    "gact": ("gact", {}),
    "division": ("division", {}),
    "comet": ("comet", {}),
    "quant2": ("fixed", {"codec": "quant", "bits": 2}),
    "quant4": ("fixed", {"codec": "quant", "bits": 4}),
}
# A policy used together with checkpointing (its blocks as ``checkpoint``'s): what the
# policy compresses is then what autograd still saves, each block's input among it.
WITH_CHECKPOINTING: dict[str, str] = {"acgc_checkpoint": "acgc"}
# A policy under other engine settings (EngineSettings fields): the same codecs.
WITH_SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "acgc_low_peak": ("acgc", {"low_peak": True}),
    "acgc_stored_products": ("acgc", {"remake_products": False}),
}
CONFIGS = ("plain", "checkpoint", *POLICIES, *WITH_CHECKPOINTING, *WITH_SETTINGS)

# The calibrating policies calibrate on the first steps of fit (acgc and comet: 3, gact:
# 1) and then every 100 steps: steps 0-2 calibrate, step 3 is an ordinary step, unless
# acgc calibrates again after a calibration over its promise (Runner.calibration_steps).
CALIBRATION_STEPS = 3
MEASURED_STEP = CALIBRATION_STEPS


# ----------------------------------------------------------------------------- recipes
def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor) or hasattr(batch, "to"):
        return batch.to(device)
    return type(batch)(_to(b, device) for b in batch)


@dataclass
class Recipe:
    """A recipe's LightningModule (fresh, seeded) and its first training batch."""

    name: str
    cfg: DictConfig
    module: nn.Module
    batch: Any
    datamodule: Any
    description: str

    def loss(self, module: nn.Module | None = None, batch: Any = None) -> torch.Tensor:
        batch = self.batch if batch is None else batch
        logits, targets = (module or self.module).logits_and_targets(batch, "train")
        return F.cross_entropy(logits, targets)

    def loss_halves(self, module: nn.Module) -> tuple[Callable[[], torch.Tensor], ...] | None:
        """The loss on each half of the batch (for a noise-relative budget); ``None`` for
        a batch that has no batch dimension to split (a full graph)."""
        if not isinstance(self.batch, (tuple, list)):
            return None
        n = self.batch[0].shape[0]
        halves = [
            type(self.batch)(t[a:b] for t in self.batch) for a, b in ((0, n // 2), (n // 2, n))
        ]
        return tuple(functools.partial(self.loss, module, h) for h in halves)


def _describe(name: str, cfg: DictConfig, batch: Any, generated: bool = False) -> str:
    m, d = cfg.model, cfg.data
    if name == "resnet":
        x = batch[0]
        stem = "CIFAR stem" if m.cifar_stem else "ImageNet stem"
        data = "generated" if generated else "digits"
        return (
            f"ResNet-{m.depth} x{m.width:g} ({stem}), {data} {tuple(x.shape[1:])}, "
            f"batch {x.shape[0]}"
        )
    if name == "bert":
        n, seq = batch[0].shape
        return (
            f"BERT {m.num_layers}x{m.hidden_size} ({m.num_heads} heads, {m.attn_implementation} "
            f"attention), text seq {seq}, batch {n}"
        )
    if name == "lm":
        n, seq = batch[0].shape
        heads = f"{m.num_heads} heads"
        if m.arch == "llama":
            kv = m.num_kv_heads or m.num_heads
            heads += f", {kv} key/value" if kv != m.num_heads else ""
        arch = "GPT-2" if m.arch == "gpt2" else "Llama"
        return (
            f"{arch} {m.num_layers}x{m.hidden_size} ({heads}, {m.attn_implementation} "
            f"attention), Python docs characters, seq {seq}, batch {n}"
        )
    edges = batch.edge_index
    sparse = not isinstance(edges, torch.Tensor) or edges.layout != torch.strided
    count = edges._nnz() if sparse else edges.shape[1]
    return (
        f"{m.arch.upper()} {m.num_layers}x{m.hidden_channels}, SBM graph {d.num_nodes} nodes, "
        f"{count} directed edges, {d.num_features} features, full batch"
        + (", sparse adjacency" if sparse else "")
    )


def build_recipe(
    name: str,
    quick: bool,
    device: torch.device,
    seed: int = 0,
    overrides: Sequence[str] = (),
) -> Recipe:
    """The recipe's model (seeded) and first training batch on ``device``, at the sizes
    of ``SIZES`` (the recipes' own data; used by the accuracy-side benchmarks)."""
    from recipes.config_schema import compose_config

    cfg = compose_config([*SIZES["quick" if quick else "full"][name], f"seed={seed}", *overrides])
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    torch.manual_seed(seed)
    module = instantiate(cfg.model).to(device).train()
    batch = _to(next(iter(datamodule.train_dataloader())), device)
    return Recipe(name, cfg, module, batch, datamodule, _describe(name, cfg, batch))


def build_case(
    case_name: str,
    quick: bool,
    device: torch.device,
    seed: int = 0,
    batch_size: int | None = None,
    overrides: Sequence[str] = (),
) -> Recipe:
    """A case of ``CASES`` (its family is the recipe's name): the model (seeded) and one
    batch on ``device``: the recipe's first training batch, or a generated one where the
    case has an image size of its own."""
    from recipes.config_schema import compose_config

    case = CASES["quick" if quick else "full"][case_name].with_batch_size(batch_size)
    cfg = compose_config([*case.compose_overrides(), f"seed={seed}", *overrides])
    datamodule = instantiate(cfg.data)
    if case.image_size is None:
        datamodule.setup("fit")
        batch = next(iter(datamodule.train_dataloader()))
        if case.sparse_adjacency:
            batch = sparse_adjacency(batch)
    else:
        batch = generated_batch(case, cfg.data.in_channels, cfg.data.num_classes, seed)
    torch.manual_seed(seed)
    module = instantiate(cfg.model).to(device).train()
    batch = _to(batch, device)
    description = _describe(case.family, cfg, batch, case.image_size is not None)
    return Recipe(case.family, cfg, module, batch, datamodule, description)


def timed_step(step: Callable[[], Any], device: torch.device) -> float:
    """Seconds that ``step()`` takes: CUDA events on a GPU, a wall clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    step()
    return time.perf_counter() - begin


def checkpoint_blocks(name: str, module: nn.Module) -> list[str]:
    """Modules that ``torch.utils.checkpoint`` wraps one by one: residual blocks (ResNet),
    encoder layers (BERT), message-passing layers (GNN), decoder layers (causal LMs)."""
    if name == "resnet":
        from recipes.models.resnet import BasicBlock, Bottleneck

        types: tuple[type, ...] = (BasicBlock, Bottleneck)
    elif name == "bert":
        from transformers.models.bert.modeling_bert import BertLayer

        types = (BertLayer,)
    elif name == "lm":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        types = (GPT2Block, LlamaDecoderLayer)
    else:
        from torch_geometric.nn.conv import MessagePassing

        types = (MessagePassing,)
    return [n for n, m in module.named_modules() if isinstance(m, types)]


def with_checkpointing(module: nn.Module, blocks: Sequence[str]) -> nn.Module:
    """A copy of ``module`` whose ``blocks`` run under non-reentrant checkpointing (the
    library's :class:`~lightning_acgc.checkpointing.CheckpointedModules`, left installed
    on the copy)."""
    model = copy.deepcopy(module)
    if blocks:
        CheckpointedModules([glob.escape(name) for name in blocks]).install(model)
    return model


# ----------------------------------------------------------------------------- counting
class _Recording(OffPolicy):
    """Compresses nothing; remembers the storages of the float tensors it was shown."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def codec_for(self, site: Any, x: torch.Tensor) -> None:
        self.storages.add(x.untyped_storage().data_ptr())
        return None


def count_saved(recipe: Recipe, module: nn.Module, blocks: Sequence[str] = ()) -> int:
    """Bytes of activations kept for backward in one plain step of ``module``.

    The engine's meter counts what autograd saves (nothing compressed), the batch
    aside: held by the caller all along, it costs plain training nothing (the engine
    holds the step's inputs as the runners' steps do). Under checkpointing autograd
    saves nothing inside a checkpointed block; what the block keeps instead is its
    inputs, which are added here (each storage once, and only if the meter did not
    count it already, nor is it the batch's).
    """
    policy = _Recording()
    engine = ActivationCompressor(
        policy, model=module, settings=EngineSettings(min_numel=0, compress_masks=False)
    )
    inputs: dict[int, int] = {}
    handles = []

    def remember(_: nn.Module, args: tuple, kwargs: dict) -> None:
        for t in (*args, *kwargs.values()):
            # (a sparse adjacency is the batch's graph, held by the caller all along)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                ptr = t.untyped_storage().data_ptr()
                inputs.setdefault(ptr, t.untyped_storage().nbytes())

    for name in blocks:
        block = module.get_submodule(name)
        handles.append(block.register_forward_pre_hook(remember, with_kwargs=True))
    engine.install()
    engine.new_step(0)
    engine.inputs.hold(recipe.batch)
    batch = engine.inputs.storages()
    try:
        module.zero_grad(set_to_none=True)
        with engine.scope() as stats:
            loss = recipe.loss(module)
        loss.backward()
    finally:
        engine.remove()
        for handle in handles:
            handle.remove()
    resident = {p.untyped_storage().data_ptr() for p in module.parameters()}
    extra = sum(n for ptr, n in inputs.items() if ptr not in policy.storages | resident | batch)
    return stats.saved_bytes + extra


# ----------------------------------------------------------------------------- runners
@dataclass
class Runner:
    """One configuration's training step (forward and backward; no optimizer step)."""

    config: str
    recipe: Recipe
    module: nn.Module
    engine: ActivationCompressor | None = None
    blocks: list[str] = field(default_factory=list)
    calibration: list[dict[str, float]] = field(default_factory=list)
    measured_step: int = MEASURED_STEP  # the first step after calibration_steps'

    @property
    def policy(self) -> Policy | None:
        return None if self.engine is None else self.engine.policy

    @property
    def calibrates(self) -> bool:
        """Whether the policy has a calibration schedule (acgc, gact, comet)."""
        return getattr(self.policy, "calibrate_every", None) is not None

    def calibration_steps(self, steps: int = CALIBRATION_STEPS) -> Iterator[int]:
        """The first ``steps`` steps, then those the policy calibrates again (acgc, after a
        calibration over its promise), each to be run before the next is asked for; then
        ``measured_step`` is the first step after them, an ordinary one."""
        step = 0
        while step < steps or (self.calibrates and self.policy.retries_at(step)):  # type: ignore[union-attr]
            yield step
            step += 1
        self.measured_step = max(step, MEASURED_STEP)

    def step(self, step: int | None = None) -> CompressionStats | None:
        step = self.measured_step if step is None else step
        self.module.zero_grad(set_to_none=True)
        if self.engine is None:
            self.recipe.loss(self.module).backward()
            return None
        wants_noise = getattr(self.policy, "needs_noise_estimate", None)
        halves = self.recipe.loss_halves(self.module) if wants_noise and wants_noise(step) else None
        compressed_step(
            self.engine,
            self.module,
            lambda: self.recipe.loss(self.module),
            step,
            loss_halves=halves,
            inputs=self.recipe.batch,
        )
        return self.engine.stats

    def calibrate(
        self, steps: int = CALIBRATION_STEPS, optimizer: torch.optim.Optimizer | None = None
    ) -> list[dict[str, float]]:
        """Run the policy's calibration (:meth:`calibration_steps`), keep its metrics."""
        for step in self.calibration_steps(steps if self.calibrates else 0):
            self.step(step)
            if self.policy is not None:
                self.calibration.append(self.policy.metrics())
            if optimizer is not None:
                optimizer.step()
        return self.calibration

    def close(self) -> None:
        if self.engine is not None:
            self.engine.remove()
            self.engine.policy.teardown()


def make_runner(config: str, recipe: Recipe, policy_options: dict | None = None) -> Runner:
    """A runner of ``config`` on its own copy of the recipe's model."""
    if config == "plain":
        return Runner(config, recipe, copy.deepcopy(recipe.module))
    if config == "checkpoint":
        blocks = checkpoint_blocks(recipe.name, recipe.module)
        return Runner(config, recipe, with_checkpointing(recipe.module, blocks), blocks=blocks)
    blocks = checkpoint_blocks(recipe.name, recipe.module) if config in WITH_CHECKPOINTING else []
    module = with_checkpointing(recipe.module, blocks)
    base, settings = WITH_SETTINGS.get(config, (WITH_CHECKPOINTING.get(config, config), {}))
    name, options = POLICIES[base]
    policy = build_policy(name, **{**options, **(policy_options or {})})
    engine = ActivationCompressor(policy, model=module, settings=EngineSettings(**settings))
    engine.install()
    policy.setup(module)
    return Runner(config, recipe, module, engine, blocks=blocks)
