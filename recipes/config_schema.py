"""Structured configs: the typed schema of every config group, for Hydra's ConfigStore.

The YAML files in ``configs/`` hold the values and their comments; these dataclasses
hold the types. Each YAML file names its schema first in its defaults list
(``- /schema/model/resnet@_here_``), so that a typo'd key
(``model.widht=2``) or an ill-typed value (``model.width=abc``) fails while Hydra
composes the config, before anything is built. Fields are ``MISSING`` here: a YAML
file that forgets one fails the same way.

Call :func:`register_configs` before composing (``recipes/train.py`` does on import).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

__all__ = ["CONFIG_DIR", "compose_config", "register_configs"]

#: ``configs/`` next to this package (the repository's config tree).
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


# ----------------------------------------------------------------------------- compression
@dataclass
class CompressionSchema:
    """Arguments of ``lightning_acgc.ActivationCompression`` shared by every policy."""

    _target_: str = MISSING
    policy: str = MISSING
    log_every_n_steps: int = MISSING
    backend: str = MISSING
    min_numel: int = MISSING
    coalesce_min_numel: int | None = MISSING
    compress_masks: bool = MISSING
    strict: bool = MISSING
    compress_loss: bool = MISSING
    low_peak: bool = MISSING
    remake_products: bool = MISSING
    seed: int = MISSING
    print_table: bool = MISSING
    scale_batch_size: str | None = MISSING
    memory_budget: Any = MISSING  # None, bytes (int) or text ("2GB")
    lr_scaling: str | None = MISSING
    checkpoint_modules: Any = MISSING  # None or module class/qualified names (list)


@dataclass
class FixedCompressionSchema(CompressionSchema):
    """``policy="fixed"``: one codec everywhere; codec options left ``None`` are not passed."""

    codec: str = MISSING
    bits: int | None = MISSING
    group_size: int | None = MISSING
    error_bound: float | None = MISSING
    relative: bool | None = MISSING


@dataclass
class ACGCCompressionSchema(CompressionSchema):
    """``policy="acgc"``: per-site error bounds from an allowed relative gradient error."""

    calibrate_every: int = MISSING
    gradient_error: float | None = MISSING
    noise_ratio: float | None = MISSING
    noise_floor: float | None = MISSING
    probes: int | None = MISSING
    probe_scope: str | None = MISSING
    rounding_floor: bool = MISSING
    target: float | None = MISSING
    verify: bool = MISSING


@dataclass
class GACTCompressionSchema(CompressionSchema):
    """``policy="gact"``: per-site bits under an average bit budget."""

    calibrate_every: int = MISSING
    bits: float = MISSING


@dataclass
class DivisionCompressionSchema(CompressionSchema):
    """``policy="division"``: low-frequency copy plus a few-bit high-frequency residual."""

    block: int = MISSING
    residual_bits: int = MISSING
    quant_bits: int = MISSING


@dataclass
class COMETCompressionSchema(CompressionSchema):
    """``policy="comet"``: error-bounded codec with an adaptive bound schedule."""

    calibrate_every: int = MISSING
    relative_bound: float = MISSING


# ----------------------------------------------------------------------------- data
@dataclass
class DataSchema:
    """Fields every data config has."""

    _target_: str = MISSING
    num_classes: int = MISSING
    seed: int = MISSING


@dataclass
class DigitsDataSchema(DataSchema):
    batch_size: int = MISSING
    val_fraction: float = MISSING
    image_size: int = MISSING
    in_channels: int = MISSING
    num_workers: int = MISSING


@dataclass
class CIFAR10DataSchema(DataSchema):
    root: str = MISSING
    batch_size: int = MISSING
    augment: bool = MISSING
    download: bool = MISSING
    fallback: bool = MISSING
    timeout_s: float = MISSING
    image_size: int = MISSING
    in_channels: int = MISSING
    num_workers: int = MISSING


@dataclass
class SyntheticTextDataSchema(DataSchema):
    num_samples: int = MISSING
    val_fraction: float = MISSING
    seq_len: int = MISSING
    vocab_size: int = MISSING
    batch_size: int = MISSING
    num_workers: int = MISSING


@dataclass
class PyTextDataSchema(DataSchema):
    seq_len: int = MISSING
    num_windows: int = MISSING
    val_fraction: float = MISSING
    batch_size: int = MISSING
    num_workers: int = MISSING


@dataclass
class GlueDataSchema(DataSchema):
    task: str = MISSING
    tokenizer: str = MISSING
    seq_len: int = MISSING
    vocab_size: int = MISSING
    max_train_samples: int | None = MISSING
    root: str = MISSING
    fallback: bool = MISSING
    timeout_s: float = MISSING
    batch_size: int = MISSING
    num_workers: int = MISSING


@dataclass
class SBMDataSchema(DataSchema):
    num_nodes: int = MISSING
    num_features: int = MISSING
    avg_degree: float = MISSING
    homophily: float = MISSING
    feature_signal: float = MISSING
    train_fraction: float = MISSING
    val_fraction: float = MISSING
    steps_per_epoch: int = MISSING


@dataclass
class CoraDataSchema(DataSchema):
    root: str = MISSING
    num_features: int = MISSING
    steps_per_epoch: int = MISSING
    fallback: bool = MISSING
    timeout_s: float = MISSING


# ----------------------------------------------------------------------------- model
@dataclass
class ModelSchema:
    """Fields every model config has (:class:`recipes.models.Classifier`'s optimizer)."""

    _target_: str = MISSING
    num_classes: int = MISSING
    optimizer: str = MISSING
    lr: float = MISSING
    weight_decay: float = MISSING
    momentum: float = MISSING
    scheduler: str = MISSING


@dataclass
class ResNetModelSchema(ModelSchema):
    in_channels: int = MISSING
    depth: int = MISSING
    width: float = MISSING
    cifar_stem: bool = MISSING
    zero_init_residual: bool = MISSING


@dataclass
class BertModelSchema(ModelSchema):
    vocab_size: int = MISSING
    max_seq_len: int = MISSING
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    intermediate_size: int = MISSING
    dropout: float = MISSING
    attn_implementation: str = MISSING
    pretrained: str | None = MISSING


@dataclass
class GNNModelSchema(ModelSchema):
    in_channels: int = MISSING
    arch: str = MISSING
    hidden_channels: int = MISSING
    num_layers: int = MISSING
    dropout: float = MISSING
    heads: int = MISSING


@dataclass
class CharLMModelSchema(ModelSchema):
    max_seq_len: int = MISSING
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    dropout: float = MISSING


@dataclass
class CausalLMModelSchema(ModelSchema):
    max_seq_len: int = MISSING
    arch: str = MISSING
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int | None = MISSING
    intermediate_size: int | None = MISSING
    dropout: float = MISSING
    attn_implementation: str = MISSING


# ----------------------------------------------------------------------------- trainer
@dataclass
class TrainerSchema:
    """The ``lightning.pytorch.Trainer`` arguments the configs set (add others with ``+``)."""

    _target_: str = MISSING
    max_epochs: int = MISSING
    accelerator: str = MISSING
    devices: Any = MISSING  # int, list or "auto"
    precision: Any = MISSING  # "32-true", "bf16-mixed", 16, ...
    fast_dev_run: Any = MISSING  # bool or a number of batches
    limit_train_batches: Any = MISSING  # None, a fraction (float) or batches (int)
    limit_val_batches: Any = MISSING
    num_sanity_val_steps: int = MISSING
    log_every_n_steps: int = MISSING
    check_val_every_n_epoch: int = MISSING
    gradient_clip_val: float | None = MISSING
    accumulate_grad_batches: int = MISSING
    deterministic: Any = MISSING  # bool or "warn"
    enable_checkpointing: bool = MISSING
    enable_progress_bar: bool = MISSING
    enable_model_summary: bool = MISSING


# ----------------------------------------------------------------------------- root
@dataclass
class TrainSchema:
    """The root config (``configs/train.yaml``)."""

    data: Any = MISSING
    model: Any = MISSING
    compression: Any = None  # None: no compression callback
    trainer: Any = MISSING
    seed: int = MISSING
    logger: bool = MISSING
    output_dir: str | None = MISSING
    summary_metric: str = MISSING


_SCHEMAS: dict[str, dict[str, type]] = {
    "compression": {
        "base": CompressionSchema,
        "fixed": FixedCompressionSchema,
        "acgc": ACGCCompressionSchema,
        "gact": GACTCompressionSchema,
        "division": DivisionCompressionSchema,
        "comet": COMETCompressionSchema,
    },
    "data": {
        "digits": DigitsDataSchema,
        "cifar10": CIFAR10DataSchema,
        "text": SyntheticTextDataSchema,
        "glue": GlueDataSchema,
        "sbm": SBMDataSchema,
        "cora": CoraDataSchema,
        "pytext": PyTextDataSchema,
    },
    "model": {
        "resnet": ResNetModelSchema,
        "bert": BertModelSchema,
        "gnn": GNNModelSchema,
        "charlm": CharLMModelSchema,
        "causal_lm": CausalLMModelSchema,
    },
    "trainer": {"default": TrainerSchema},
}


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore under ``schema/<group>/<name>``
    (and the root as ``schema/train``); calling it again changes nothing."""
    cs = ConfigStore.instance()
    cs.store(group="schema", name="train", node=TrainSchema)
    for group, schemas in _SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The root config composed with Hydra's compose API, as ``recipes/train.py`` would
    see it with these command-line overrides (without Hydra's own ``hydra`` node).

    Raises:
        hydra.errors.ConfigCompositionException: an unknown option, key or ill-typed value.

    Example:
        >>> cfg = compose_config(["model=bert", "compression=gact", "compression.bits=3"])
        >>> cfg.data._target_, cfg.compression.bits
        ('recipes.data.SyntheticTextDataModule', 3.0)
    """
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("train", overrides=list(overrides))
