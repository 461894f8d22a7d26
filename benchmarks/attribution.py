"""Which stored tensors carry a calibration's error: acgc's verified error on one
calibration step, with one class of the tensors it stores compressed at a time.

A calibration measures the error of all the settings it allocated at once; the error
model splits its prediction by tensor, the measurement does not. Here a fit of a sweep
recipe (:data:`benchmarks.sweep.RECIPES`, acgc at its default, calibrating every
``--calibrate-every`` steps) runs up to calibration step ``--step`` once with every
tensor and once per class of the tensors acgc stores at a width of its choosing
(:func:`~lightning_acgc.policies.acgc_probes.tensor_class`: the same tensor of every
block, e.g. every decoder layer's attention-norm input). On that step only that class is
compressed, at the widths the calibration allocated, every other tensor is kept as it
is; the step's verified readings are taken (the global error against e, the worst
layer's against its bound) and the fit stops. The fits are the same up to that step
(seed, data order, and the compressed steps before it), so each class's reading is the
error its rounding alone puts on that calibration. Independent roundings add in
variance: where the classes' squared global readings sum to far less than the whole's
square, their errors interact.

Prints one JSON line: the calibration with every class, then per class its sites, their
widths on that step and its readings.

    python -m benchmarks.attribution --recipe llama --seed 1 --step 5
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf

from benchmarks._harness import emit, machine, resolve_device
from benchmarks.promise import PromiseRecorder, acgc_config, fit_recipe
from benchmarks.sweep import RECIPES
from lightning_acgc import ActivationCompression
from lightning_acgc.codecs.base import Codec
from lightning_acgc.engine.meter import RAW_CODECS
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies.acgc import ACGCPolicy
from lightning_acgc.policies.acgc_probes import tensor_class

__all__ = ["OneClassAt", "attribute", "fit_to_step"]


class OneClassAt(ACGCPolicy):
    """acgc as configured, except on step ``step``: only the tensors of class ``only``
    are compressed (None: all, as acgc would), each at the setting acgc chose for it;
    the others are kept as they are. ``chosen``: on that step, each site acgc chose a
    codec for, and its setting.

    Example:
        >>> policy = OneClassAt(5, "net.layers.*.norm:0", gradient_error=0.05)
        >>> policy.at, policy.only, policy.gradient_error
        (5, 'net.layers.*.norm:0', 0.05)
    """

    def __init__(self, step: int, only: str | None, **options: Any) -> None:
        super().__init__(**options)
        self.at = step
        self.only = only
        self.chosen: dict[str, str] = {}
        self._now = -1

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self._now = step

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        codec = super().codec_for(site, x)  # the policy's own notes of the tensor, too
        if self._now != self.at or codec is None:
            return codec
        self.chosen[site.key] = self.describe(codec)
        return codec if self.only in (None, tensor_class(site.key)) else None


class _StopAfter(PromiseRecorder):
    """The promise's recorder (listed after the compression callback) that, after the
    policy's step ``at``, keeps that step's reading and the sites encoded by its
    codecs, then stops the fit."""

    def __init__(self, compression: ActivationCompression) -> None:
        super().__init__(compression.policy)
        self.compression = compression
        self.reading: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        p: OneClassAt = self.policy
        if trainer.global_step - 1 != p.at or not self.readings:
            return
        r = self.readings[-1]
        if r["step"] != p.at:  # (not a verified calibration: no reading, fit_to_step raises)
            return
        classes: dict[str, dict[str, str]] = {}
        for key, setting in sorted(p.chosen.items()):
            classes.setdefault(tensor_class(key), {})[key] = setting
        sites = self.compression.engine.stats.sites
        self.reading = {
            "encoded": [k for k in p.chosen if k in sites and sites[k].codec not in RAW_CODECS],
            "global": round(r["grad_error"] / r["error_target"], 4),
            "worst_layer": round(r["layer_budget_use"], 4),
            "worst_module": r["module"],
            "classes": classes,
        }
        trainer.should_stop = True


def fit_to_step(
    recipe: str, seed: int, step: int, only: str | None, calibrate_every: int = 5
) -> dict[str, Any]:
    """One fit of the sweep's ``recipe`` with acgc at its default up to calibration step
    ``step``, on which only class ``only`` (None: all) is compressed: that step's
    readings, and the classes acgc set widths for."""
    cfg = acgc_config(recipe, seed, calibrate_every)
    spec = OmegaConf.to_container(cfg.compression, resolve=True)
    assert isinstance(spec, dict)
    spec.pop("_target_", None)
    spec.pop("policy", None)
    own = {k: spec.pop(k) for k in list(spec) if k in ACGCPolicy.options}
    policy = OneClassAt(step, only, **{k: v for k, v in own.items() if v is not None})
    if not policy.is_calibration_step(step):
        raise ValueError(f"step={step} is not a calibration step of this schedule")
    stop = _StopAfter(ActivationCompression(policy=policy, **spec))
    fit_recipe(cfg, [stop.compression, stop])
    if stop.reading is None:
        raise RuntimeError(f"the fit ended before step {step}")
    return stop.reading


def attribute(recipe: str, seed: int, step: int, calibrate_every: int = 5) -> dict[str, Any]:
    """The calibration at ``step`` with every class, then with each class alone."""
    whole = fit_to_step(recipe, seed, step, None, calibrate_every)
    classes = []
    for cls, info in whole["classes"].items():
        alone = fit_to_step(recipe, seed, step, cls, calibrate_every)
        readings = {k: alone[k] for k in ("encoded", "global", "worst_layer", "worst_module")}
        classes.append({"class": cls, "settings": info, **readings})
        print(f"attribution: {cls}: global {alone['global']}, worst layer "
              f"{alone['worst_layer']} ({alone['worst_module']})", flush=True)  # fmt: skip
    alone_sq = sum(c["global"] ** 2 for c in classes)
    return {
        "calibration": {k: whole[k] for k in ("global", "worst_layer", "worst_module")},
        "classes": classes,
        "classes_global": round(math.sqrt(alone_sq), 4),  # the whole's, were they independent
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", choices=list(RECIPES), default="llama")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--step", type=int, default=5, help="a calibration step")
    parser.add_argument("--calibrate-every", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {
        "benchmark": "attribution",
        "machine": machine(resolve_device("cpu")),
        "recipe": args.recipe,
        "seed": args.seed,
        "step": args.step,
        "calibrate_every": args.calibrate_every,
        **attribute(args.recipe, args.seed, args.step, args.calibrate_every),
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
