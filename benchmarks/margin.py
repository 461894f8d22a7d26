"""What acgc's margin (``target``) trades: the per-layer promise over fits against ratio.

acgc aims each allocation at ``target`` · e² (its margin; the policy's default 0.35). A
looser margin keeps more memory at a fixed setting's error and at the default e, and
keeps the per-layer promise on fewer calibrations (the errors that reach a layer through
δ move between calibrations). For each target in ``--targets``, side by side in one run:

* on the recipes' quick models (``benchmarks/acgc_vs_fixed.py``'s measurement: the
  calibration steps, then one measured step against the exact gradient of the same
  batch): acgc with ``gradient_error`` at fixed 2-bit's, 4-bit's and gact's measured
  error (the settings are measured once per model), its share of their ratio and
  whether it measured within; acgc at its default e, its ratio and worst layer;
* over whole fits (``benchmarks/promise.py``: the sweep's recipes at the default e,
  calibrating every ``--calibrate-every`` steps; ``--quick``: the char-LM and the GNN,
  one seed): the verified calibrations that kept the global promise, the per-layer one
  and both, and the fits' ratios.

Prints one JSON line.

    python -m benchmarks.margin [--quick] [--targets 0.35 0.45 0.6 1.0]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from benchmarks._harness import (
    MODELS,
    add_common_arguments,
    build_recipe,
    count_saved,
    emit,
    machine,
    resolve_device,
    setup_threads,
)
from benchmarks.acgc_vs_fixed import BASELINES, acgc_at_error, acgc_default, measure_setting
from benchmarks.promise import FULL_RECIPES, QUICK_RECIPES, band_summary, fit_with_acgc
from lightning_acgc.policies.acgc import ACGCPolicy

__all__ = ["TARGETS", "fits_summary", "model_rows"]

TARGETS = (0.35, 0.45, 0.6, 1.0)  # the policy's default (recorded as default_target) first;
# 1.0: no margin, each allocation aims at e² itself
KEPT = ("calibrations", "global_kept", "layer_kept", "kept")
HELD_OUT = ("held_out_checks", "held_out_kept")


def model_rows(
    name: str, targets: list[float], device: torch.device
) -> tuple[str, dict[str, Any], dict[str, dict[str, Any]]]:
    """(description, the settings' measurements, per target acgc's at each setting's
    error and at its default) on recipe ``name``'s quick model."""
    recipe = build_recipe(name, True, device)
    plain = count_saved(recipe, recipe.module)
    settings = {config: measure_setting(recipe, config, plain) for config in BASELINES}
    per_target: dict[str, dict[str, Any]] = {}
    for target in targets:
        options = {"target": target}
        rows = {c: acgc_at_error(recipe, plain, base, options) for c, base in settings.items()}
        rows["acgc_default"] = acgc_default(recipe, plain, options)
        per_target[str(target)] = rows
    return recipe.description, settings, per_target


def fits_summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per recipe and in all: calibrations, how many kept the global promise, the
    per-layer one and both, the fits' median ratio, and (where the runs hold them) the
    held-out checks on the step after each calibration and how many kept both promises,
    and the median calibration's global error over e and worst layer's use of its bound.

    Example:
        >>> run = {"recipe": "gnn", "calibrations": 6, "global_kept": 6, "layer_kept": 5,
        ...        "kept": 5, "ratio": 9.5}
        >>> fits_summary([run, {**run, "layer_kept": 6, "kept": 6, "ratio": 9.9}])["gnn"]
        {'calibrations': 12, 'global_kept': 12, 'layer_kept': 11, 'kept': 11, 'ratio': 9.7}
    """
    out: dict[str, dict[str, Any]] = {}
    for name in [*dict.fromkeys(r["recipe"] for r in runs), "all"]:
        mine = [r for r in runs if name in ("all", r["recipe"])]
        out[name] = {k: sum(r[k] for r in mine) for k in KEPT}
        for key in HELD_OUT:  # the step after each calibration (benchmarks/_held_out.py)
            if all(key in r for r in mine):
                out[name][key] = sum(r[key] for r in mine)
        if all("global_use" in r for r in mine):  # the budget used (issue 13's band)
            out[name].update(band_summary(mine))
        if name != "all":
            out[name]["ratio"] = round(statistics.median(r["ratio"] for r in mine), 2)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser)
    parser.add_argument("--targets", nargs="+", type=float, default=list(TARGETS))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--recipes", nargs="+", default=None, help="the fits (promise.py's)")
    parser.add_argument("--seeds", type=int, default=None, help="fits per recipe")
    parser.add_argument("--calibrate-every", type=int, default=5)
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = 1  # as promise.py's fits
    setup_threads(args)
    device = resolve_device(args.device)
    torch.manual_seed(0)
    models: dict[str, Any] = {}
    for name in args.models:
        description, settings, per_target = model_rows(name, args.targets, device)
        models[name] = {"description": description, "settings": settings, "acgc": per_target}
    plan = dict(QUICK_RECIPES if args.quick else FULL_RECIPES)
    if args.recipes:
        plan = {r: plan.get(r, 1 if args.quick else 3) for r in args.recipes}
    fits: dict[str, Any] = {}
    for target in args.targets:  # one target's fits after the other's
        runs = [
            fit_with_acgc(recipe, seed, args.calibrate_every, target)
            for recipe, seeds in plan.items()
            for seed in range(args.seeds if args.seeds is not None else seeds)
        ]
        fits[str(target)] = fits_summary(runs)
        print(f"margin: target {target}: {fits[str(target)]['all']}", flush=True)
    result = {
        "benchmark": "margin",
        "mode": "quick" if args.quick else "full",
        "machine": machine(device),
        "targets": args.targets,
        "default_target": ACGCPolicy().target,
        "calibrate_every": args.calibrate_every,
        "models": models,
        "fits": fits,
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
