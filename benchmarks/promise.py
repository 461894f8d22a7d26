"""acgc's promise over whole fits: how many verified calibrations keep it.

acgc promises ‖ĝ − g‖ ≤ e‖g‖ on its calibration steps, globally and per layer (each
module held to its own e_m‖g_m‖). The trade-off and acgc_vs_fixed benchmarks check one
measured step after a few calibrations; this one counts every calibration of real fits.
Each recipe of the paired-seed sweep (:data:`benchmarks.sweep.RECIPES`: the char-LM on
real text, the ResNet, BERT and GNN recipes) is trained with acgc at its default,
calibrating every ``--calibrate-every`` steps (5: ~27 calibrations a char-LM fit instead
of 4), one fit per seed. Every verified calibration logs ``grad_error`` (‖ĝ − g‖/‖g‖ of
the step, the settings in force against the exact gradient of the same batch) and
``layer_budget_use`` (the worst module's ‖ĝ_m − g_m‖ / (e_m‖g_m‖), ‖g_m‖² the larger of
the step's and the recent calibrations' mean: the scale Adam divides by,
``ModelCorrections.layer_scale``); a calibration keeps the promise when the first is ≤ e
and the second ≤ 1. ``layer_step_kept`` counts the calibrations whose every layer was also
within e_m of that step's own ‖g_m‖ (the stricter reading: an attention key's ‖g_m‖ moves
10⁴x within a few steps).

A calibration's reading is taken on the batch its settings were allocated on;
``held_out_kept`` counts the checks on the first step after each calibration, its
settings in force on a batch they were not allocated on (``benchmarks/_held_out.py``;
each reading, global and worst layer against their bounds, in ``held_out_use``).

Prints one JSON line: per recipe and seed the calibrations, how many kept each promise,
the worst readings (and, per broken calibration, the module that used most of its
bound), the final ratio and validation loss; per recipe and in all, the
share of calibrations that kept both, and how many readings landed in :data:`BAND`
([0.5, 1] of their bound: the budget used, issue 13), with their medians.
``--quick``: the char-LM and the GNN, one seed.

    python -m benchmarks.promise [--quick] [--seeds 0 1 2] [--calibrate-every 5]
        [--target T]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from benchmarks._harness import emit, machine, resolve_device
from benchmarks._held_out import HeldOutCheck
from benchmarks._promise_bars import BAND
from benchmarks.sweep import QUIET, RECIPES

__all__ = [
    "BAND",
    "PromiseRecorder",
    "acgc_config",
    "band_summary",
    "fit_recipe",
    "fit_with_acgc",
    "in_band",
    "summarize",
]

FULL_RECIPES = {"charlm": 5, "resnet": 3, "bert": 3, "gnn": 3}  # recipe -> seeds
QUICK_RECIPES = {"charlm": 1, "gnn": 1}


def in_band(use: float) -> bool:
    """Whether a reading (error over its bound) lies in :data:`BAND`.

    Example:
        >>> in_band(0.6), in_band(0.2), in_band(1.05)
        (True, False, False)
    """
    return BAND[0] <= use <= BAND[1]


class PromiseRecorder(pl.Callback):
    """After each training step (listed after ``ActivationCompression``, whose step has
    ended by then): the policy's metrics of a verified calibration."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.readings: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        m = self.policy.metrics()
        if "grad_error" in m and "layer_budget_use" in m:
            self.readings.append({
                "step": trainer.global_step - 1,
                "grad_error": m["grad_error"],
                "error_target": m.get("error_target", self.policy.gradient_error),
                "layer_budget_use": m["layer_budget_use"],
                "layer_step_use": m.get("layer_step_use", m["layer_budget_use"]),
                "module": getattr(self.policy, "worst_layer", None),
            })  # fmt: skip


def acgc_config(
    recipe: str, seed: int, calibrate_every: int, target: float | None = None
) -> DictConfig:
    """The composed config of the sweep's ``recipe`` with acgc at its default
    (``target``: its margin, None: its own), calibrating every ``calibrate_every``."""
    from recipes.config_schema import compose_config

    overrides = [*RECIPES[recipe], *QUIET, "compression=acgc", f"seed={seed}",
                 f"compression.calibrate_every={calibrate_every}"]  # fmt: skip
    if target is not None:
        overrides.append(f"compression.target={target}")
    cfg = compose_config(overrides)
    cfg.compression.print_table = False
    return cfg


def fit_recipe(cfg: DictConfig, callbacks: list[pl.Callback]) -> pl.Trainer:
    """Train ``cfg``'s model on its data (seeded by ``cfg.seed``) with ``callbacks``."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    trainer.fit(model, datamodule=datamodule)
    return trainer


def fit_with_acgc(
    recipe: str, seed: int, calibrate_every: int, target: float | None = None
) -> dict[str, Any]:
    """One fit of the sweep's ``recipe`` with acgc at its default (``target``: its margin,
    None: its own): its calibrations."""
    cfg = acgc_config(recipe, seed, calibrate_every, target)
    callback = instantiate(cfg.compression)
    recorder = PromiseRecorder(callback.policy)
    held_out = HeldOutCheck(callback)
    start = time.perf_counter()
    trainer = fit_recipe(cfg, [callback, recorder, held_out])
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    readings = recorder.readings
    kept_global = [r["grad_error"] <= r["error_target"] for r in readings]
    kept_layer = [r["layer_budget_use"] <= 1 for r in readings]
    kept_step = [r["layer_step_use"] <= 1 for r in readings]  # against the step's own ‖g_m‖
    ratios = [r["grad_error"] / r["error_target"] for r in readings]
    layer_uses = [r["layer_budget_use"] for r in readings]
    uses = {
        "global_use": [round(g, 3) for g in ratios],
        "layer_use": [round(u, 3) for u in layer_uses],
    }
    broken = [
        {
            "step": r["step"],
            "layer": round(r["layer_budget_use"], 3),
            "layer_step": round(r["layer_step_use"], 3),
            "global": round(g, 3),
            "module": r["module"],
        }
        for r, g, a, b in zip(readings, ratios, kept_global, kept_layer, strict=True)
        if not (a and b)
    ]
    return {
        "recipe": recipe,
        "seed": seed,
        "calibrations": len(readings),
        "global_kept": sum(kept_global),
        "layer_kept": sum(kept_layer),
        "layer_step_kept": sum(kept_step),
        "kept": len(readings) - len(broken),
        "worst_global": round(max(ratios, default=math.nan), 3),
        "worst_layer": round(max(layer_uses, default=math.nan), 3),
        "worst_module": max(readings, key=lambda r: r["layer_budget_use"])["module"]
        if readings
        else None,
        "broken_at": broken,
        **uses,  # each calibration's reading against its bound (e; the layer's e_m)
        # the step after each calibration, its settings in force (benchmarks/_held_out.py)
        "held_out_checks": len(held_out.readings),
        "held_out_kept": sum(g <= 1 and u <= 1 for g, u in held_out.readings),
        "held_out_use": [[round(g, 3), round(u, 3)] for g, u in held_out.readings],
        **band_summary([uses]),  # how many in the band, and the fit's medians
        "ratio": round(metrics.get("acgc/ratio", math.nan), 3),
        "val_loss": round(metrics.get("val/loss", math.nan), 4),
        "fit_seconds": round(time.perf_counter() - start, 1),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per recipe and in all: calibrations, kept, and the share kept.

    Example:
        >>> summarize([{"recipe": "a", "calibrations": 4, "kept": 3, "worst_layer": 1.2},
        ...            {"recipe": "a", "calibrations": 4, "kept": 4, "worst_layer": 0.9}])
        {'a': {'calibrations': 8, 'kept': 7, 'share': 0.875, 'worst_layer': 1.2}, 'all': {'calibrations': 8, 'kept': 7, 'share': 0.875, 'worst_layer': 1.2}}
    """  # noqa: E501
    out: dict[str, Any] = {}
    for name in [*dict.fromkeys(r["recipe"] for r in runs), "all"]:
        mine = [r for r in runs if name in ("all", r["recipe"])]
        n, kept = sum(r["calibrations"] for r in mine), sum(r["kept"] for r in mine)
        out[name] = {
            "calibrations": n,
            "kept": kept,
            "share": round(kept / n, 4) if n else math.nan,
            "worst_layer": max(r["worst_layer"] for r in mine),
        }
        for key in ("layer_step_kept", "held_out_checks", "held_out_kept"):
            if all(key in r for r in mine):
                out[name][key] = sum(r[key] for r in mine)
        if all("global_use" in r for r in mine):
            out[name].update(band_summary(mine))
    return out


def band_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the fits' calibrations: how many readings lie in :data:`BAND`, and the median
    reading, of the global error over e and of the worst layer's use of its bound.

    Example:
        >>> band_summary([{"global_use": [0.02, 0.3, 0.6], "layer_use": [0.1, 0.5, 0.7]}])
        {'global_in_band': 1, 'median_global': 0.3, 'layer_in_band': 2, 'median_layer': 0.5}
    """
    out: dict[str, Any] = {}
    for kind in ("global", "layer"):
        uses = [u for r in runs for u in r[f"{kind}_use"]]
        out[f"{kind}_in_band"] = sum(in_band(u) for u in uses)
        out[f"median_{kind}"] = round(statistics.median(uses), 3) if uses else None
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="char-LM and GNN, one seed")
    parser.add_argument("--full", action="store_true", help="every recipe (the default)")
    parser.add_argument("--device", default="cpu", help="the fits run on the CPU")
    parser.add_argument("--seeds", nargs="+", type=int, help="default: per recipe")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES))
    parser.add_argument("--calibrate-every", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--target", type=float, default=None, help="acgc's margin (its own)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    plan = QUICK_RECIPES if args.quick else FULL_RECIPES
    if args.recipes:
        plan = {r: plan.get(r, 3) for r in args.recipes}
    runs = []
    for recipe, seeds in plan.items():
        for seed in args.seeds if args.seeds is not None else range(seeds):
            runs.append(fit_with_acgc(recipe, seed, args.calibrate_every, args.target))
            r = runs[-1]
            print(f"promise: {recipe} seed {seed}: {r['kept']}/{r['calibrations']} kept, "
                  f"worst layer {r['worst_layer']}, ratio {r['ratio']}", flush=True)  # fmt: skip
    result = {
        "benchmark": "promise",
        "mode": "quick" if args.quick else "full",
        "machine": machine(resolve_device(args.device)),
        "calibrate_every": args.calibrate_every,
        "target": args.target,
        "runs": runs,
        "summary": summarize(runs),
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
