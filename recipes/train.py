"""Train a recipe (ResNet, BERT or GNN) from the Hydra configs in ``configs/``.

Examples::

    python recipes/train.py                                  # ResNet-18 on digits, no compression
    python recipes/train.py compression=acgc                 # the same with AC-GC
    python recipes/train.py model=bert compression=acgc compression.gradient_error=0.02
    python recipes/train.py model=gnn compression=gact compression.bits=3
    python recipes/train.py -m compression=none,acgc         # one job per choice

Prints one summary line at the end: the final metric and the activation compression ratio.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError

from recipes.config_schema import _SCHEMAS, register_configs

__all__ = ["compression_option_hint", "summary_line", "train"]

RATIO_KEY = "acgc/ratio"  # what ActivationCompression logs: saved bytes / packed bytes

register_configs()


def _output_dir(cfg: DictConfig) -> Path | None:
    if cfg.output_dir is not None:
        return Path(cfg.output_dir)
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return None


def _check_resolves(cfg: DictConfig) -> None:
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except InterpolationKeyError as err:
        raise ValueError(
            f"the config does not resolve: {err}. Model and data must fit together: "
            f"model=resnet takes data=digits or data=cifar10, model=bert data=text or "
            f"data=glue, model=gnn data=sbm or data=cora"
        ) from err


def _compression_fields() -> dict[str, set[str]]:
    """The options each ``compression=<name>`` config takes (from its schema)."""
    return {
        name: {f.name for f in dataclasses.fields(schema)}
        for name, schema in _SCHEMAS["compression"].items()
        if name != "base"
    }


def compression_option_hint(overrides: Sequence[str]) -> str | None:
    """What to say when a ``compression.<option>`` override names an option that the
    chosen compression config (``compression=none`` by default) does not take; ``None``
    when every such option is taken, or when an experiment overlay may choose it.

    Hydra alone says ``Key 'gradient_error' is not in struct``, which does not tell
    the user which config takes the option.

    Example:
        >>> print(compression_option_hint(["compression.gradient_error=0.1"]))
        ... # doctest: +ELLIPSIS
        compression.gradient_error=0.1: ...; use compression=acgc compression.gradient_error=0.1
        >>> compression_option_hint(["compression=acgc", "compression.gradient_error=0.1"])
    """
    if any(re.match(r"\+*experiment=", o) for o in overrides):
        return None
    choice = "none"
    for o in overrides:
        m = re.match(r"\+*compression=(.*)$", o)
        if m:
            choice = m.group(1)
    fields = _compression_fields()
    if "," in choice or (choice != "none" and choice not in fields):
        return None  # a sweep, or a name Hydra reports itself
    for o in overrides:
        m = re.match(r"\+*compression\.(\w+)=", o)
        if m is None or m.group(1) in fields.get(choice, set()):
            continue
        option = m.group(1)
        takers = sorted(name for name, names in fields.items() if option in names)
        if not takers:
            return (
                f"{o}: no compression config takes {option!r}; the options of "
                f"compression={choice if choice != 'none' else 'fixed'} are "
                f"{sorted(fields[choice if choice != 'none' else 'fixed'] - {'_target_'})}"
            )
        example = " or ".join(f"compression={t} {o.lstrip('+')}" for t in takers)
        chosen = "the default compression=none" if choice == "none" else f"compression={choice}"
        return f"{o}: {chosen} has no option {option!r}; use {example}"
    return None


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit ``cfg.model`` on ``cfg.data`` with ``cfg.trainer`` and optional compression.

    The compression callback is built first, so that a bad compression option fails
    before any data or model is built.

    Args:
        cfg: the composed root config (``configs/train.yaml``).

    Returns:
        The final metrics (``trainer.callback_metrics`` as floats: ``val/acc``,
        ``val/loss``, ``train/acc``, ``train/loss``, ``acgc/*`` when compressing) and
        ``fit_seconds``.

    Raises:
        ValueError: a config that does not resolve or a bad value in one (the messages
            of the classes built, wrapped by Hydra's ``InstantiationException``).
    """
    _check_resolves(cfg)
    callbacks = [] if cfg.compression is None else [instantiate(cfg.compression)]
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    out = _output_dir(cfg)
    logger = CSVLogger(out, name="csv", version="") if (cfg.logger and out is not None) else False
    trainer: pl.Trainer = instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=logger,
        default_root_dir=None if out is None else str(out),
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    metrics["fit_seconds"] = time.perf_counter() - start
    print(summary_line(cfg, datamodule, trainer, metrics))
    return metrics


def summary_line(
    cfg: DictConfig, datamodule: pl.LightningDataModule, trainer: pl.Trainer, metrics: dict
) -> str:
    """One line: model, data, compression, the final metric and the compression ratio."""
    model = cfg.model._target_.rsplit(".", 1)[-1]
    data = getattr(datamodule, "source", "") or cfg.data._target_.rsplit(".", 1)[-1]
    if cfg.compression is None:
        compression, ratio = "none", "activations not compressed"
    else:
        compression = cfg.compression.policy
        value = metrics.get(RATIO_KEY)
        ratio = (
            f"activations {value:.2f}x smaller ({RATIO_KEY})"
            if value is not None and math.isfinite(value)
            else f"no {RATIO_KEY} logged"
        )
    name = cfg.summary_metric
    value = metrics.get(name, float("nan"))
    return (
        f"summary: {model} on {data}, compression={compression}, "
        f"{trainer.current_epoch} epochs, {trainer.global_step} steps: "
        f"{name}={value:.4f}, {ratio}, {metrics['fit_seconds']:.0f} s"
    )


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> float | None:
    """Entry point: train and return the summary metric (for Hydra sweepers)."""
    return train(cfg).get(cfg.summary_metric)


if __name__ == "__main__":
    hint = compression_option_hint(sys.argv[1:])
    if hint is not None:
        sys.exit(f"error: {hint}")
    main()
