"""acgc against fixed settings at their own gradient error, on the recipes' models.

For each model: fixed 2-bit and 4-bit ``quant`` and ``gact`` at its default are run for
their calibration steps, then one measured step; their relative gradient error
‖ĝ − g‖/‖g‖ (exact gradient of the same batch, dropout masks alike) and compression ratio
(bytes plain training saves / bytes kept) are recorded. Then ``acgc`` with
``gradient_error`` set to each of those errors, and ``acgc`` at its default, measured the
same way (goal: within the error, at >= 95% of the fixed setting's ratio). The fixed
settings promise only the global error; acgc also holds every layer's own gradient to e.
So acgc is measured a second time at each setting's error with the global promise alone
(``layer_floor=1``: no module held per layer), which shows what the per-layer promise
costs. acgc at its default is measured twice: as it is (its probes measure the effect of
the tensors of modules that save a saturating output, one pass per class), and with its
probes off (``probes=0``: every such effect guessed by its model, as before ec448c6).
Also logged: acgc's calibration-step errors (its promise), its worst layer, κ, and the
calibration's cost.

Prints one JSON line.

    python -m benchmarks.acgc_vs_fixed --quick [--models resnet bert gnn] [--plot PNG]
    python -m benchmarks.acgc_vs_fixed [--cases resnet50_imagenet bert_base gcn_256]

Full mode measures the recipes at their default sizes and, with ``--cases``, the size
presets of the memory and speed benchmarks (default: their one case per family; generated
inputs, as there).

``--plot`` draws the trade-off (ratio vs measured gradient error, one curve per policy,
one panel per model), e.g. ``docs/acgc_vs_fixed.png``.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from benchmarks._cases import CASES, DEFAULT_CASES
from benchmarks._harness import (
    MODELS,
    POLICIES,
    add_common_arguments,
    build_case,
    build_recipe,
    count_saved,
    emit,
    machine,
    make_runner,
    progress,
    resolve_device,
    setup_threads,
)
from lightning_acgc.engine.cycle import exact_gradients

# acgc's layer_floor that holds no module to e on its own: the global promise alone
GLOBAL_ONLY = 1.0
NO_PROBES = 0  # acgc's default measured a second time with its probes off

BASELINES = {
    "quant2": ("fixed", {"codec": "quant", "bits": 2}),
    "quant4": ("fixed", {"codec": "quant", "bits": 4}),
    "gact": ("gact", {}),
}


def measure(
    recipe: Any, config: str, plain_bytes: int, options: dict | None = None, limit: float = 0.0
) -> dict:
    """Calibration steps, then one measured step with its error against the exact
    gradient of the same batch, globally and per module: ``layer_grad_error`` (the worst
    module's ‖ĝ_m − g_m‖/‖g_m‖) and ``layers_over_error`` (modules over ``limit``, or
    over the global error where ``limit`` is 0: the per-layer promise acgc keeps)."""
    runner = make_runner(config, recipe, options)
    try:
        calibration = runner.calibrate()
        loss = lambda: recipe.loss(runner.module)
        exact = exact_gradients(runner.engine, runner.module, loss)
        stats = runner.step()
        module_g: dict[str, float] = {}
        module_err: dict[str, float] = {}
        for name, p in runner.module.named_parameters():
            if name in exact and p.grad is not None:
                ref, module = exact[name].double(), name.rpartition(".")[0]
                module_g[module] = module_g.get(module, 0.0) + float(ref.square().sum())
                err = float((p.grad.double() - ref).square().sum())
                module_err[module] = module_err.get(module, 0.0) + err
        g_sq, err_sq = sum(module_g.values()), sum(module_err.values())
        error = math.sqrt(err_sq / g_sq)
        # the per-layer promise (modules above acgc's layer floor)
        held = [m for m, g in module_g.items() if g > 1e-12 * g_sq]
        bound = limit or error
        over = [m for m in held if module_err[m] > bound**2 * module_g[m]]
        row: dict[str, Any] = {
            "grad_error": round(error, 5),
            "ratio": round(plain_bytes / stats.packed_bytes, 3),
            "layer_grad_error": round(max(math.sqrt(module_err[m] / module_g[m]) for m in held), 5),
            "layers_over_error": f"{len(over)}/{len(held)}",
        }
        measured = [m["grad_error"] for m in calibration if "grad_error" in m]
        if measured:
            row["calib_errors"] = [round(m, 5) for m in measured]
        last = calibration[-1] if calibration else {}
        for key in (
            "kappa",
            "lambda",
            "avg_bits",
            "calib_ms",
            "noise_error",
            "error_target",
            "layer_budget_use",
        ):
            if key in last:
                row[key] = round(last[key], 4)
        return row
    finally:
        runner.close()


def measure_setting(recipe: Any, config: str, plain: int) -> dict[str, Any]:
    """Fixed setting ``config`` (of :data:`BASELINES`) measured on ``recipe``."""
    POLICIES[config] = BASELINES[config]
    return measure(recipe, config, plain)


def acgc_at_error(recipe: Any, plain: int, base: dict, options: dict) -> dict[str, Any]:
    """acgc with ``gradient_error`` at the setting ``base``'s measured error (at most
    0.99): whether it measured within it, and its share of the setting's ratio."""
    e = min(base["grad_error"], 0.99)
    row = measure(recipe, "acgc", plain, {"gradient_error": e, **options}, e)
    row["within"] = row["grad_error"] <= e
    row["ratio_share"] = round(row["ratio"] / base["ratio"], 3)
    return row


def acgc_default(recipe: Any, plain: int, options: dict) -> dict[str, Any]:
    """acgc at its default e, within the error target of its last calibration (a
    noise-relative budget sets one per layer too: layer_budget_use <= 1)."""
    row = measure(recipe, "acgc", plain, options)
    row["within"] = row["grad_error"] <= row.get("error_target", 0.05)
    return row


def compare_model(name: str, args: argparse.Namespace, case: bool = False) -> dict[str, Any]:
    """The settings and acgc on recipe ``name`` (or size-preset case ``name``)."""
    device = resolve_device(args.device)
    build = build_case if case else build_recipe
    recipe = build(name, args.quick, device)
    plain = count_saved(recipe, recipe.module)
    rows: dict[str, Any] = {}
    for config in BASELINES:  # each setting, then acgc at its error (in this order)
        base = measure_setting(recipe, config, plain)
        # also held to the setting's own promise, the global error alone (no module is
        # held to e per layer): what the per-layer promise costs
        glob = {**args.acgc_options, "layer_floor": GLOBAL_ONLY}
        rows[config] = {
            "baseline": base,
            "acgc_at_its_error": acgc_at_error(recipe, plain, base, args.acgc_options),
            "acgc_global_only": acgc_at_error(recipe, plain, base, glob),
        }
    # acgc at its default, and with its probes off (quant only)
    defaults = {"acgc_default": {}}
    if args.acgc_options.get("codec", "quant") == "quant":
        defaults["acgc_default_no_probes"] = {"probes": NO_PROBES}
    for key, extra in defaults.items():
        rows[key] = acgc_default(recipe, plain, {**args.acgc_options, **extra})
    return {"description": recipe.description, "plain_bytes": plain, "results": rows}


def plot(result: dict[str, Any], path: str) -> None:
    """Ratio vs measured gradient error: fixed quant (2, 4 bits), gact, acgc (and acgc
    held to the global promise alone, where measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
    for ax, (name, model) in zip(axes[0], models.items(), strict=True):
        rows = model["results"]
        curves = {
            "fixed quant (2, 4 bits)": [rows[c]["baseline"] for c in ("quant4", "quant2")],
            "gact (default)": [rows["gact"]["baseline"]],
            "acgc": sorted(
                [rows[c]["acgc_at_its_error"] for c in BASELINES] + [rows["acgc_default"]],
                key=lambda r: r["grad_error"],
            ),
            "acgc default, probes=0": [rows["acgc_default_no_probes"]]
            if "acgc_default_no_probes" in rows
            else [],
            "acgc, global promise only": sorted(
                [rows[c]["acgc_global_only"] for c in BASELINES if "acgc_global_only" in rows[c]],
                key=lambda r: r["grad_error"],
            ),
        }
        for label, points in curves.items():
            if not points:
                continue
            xs = [p["grad_error"] for p in points]
            ax.plot(xs, [p["ratio"] for p in points], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("measured gradient error ‖ĝ − g‖/‖g‖")
        ax.set_ylabel("compression ratio")
        ax.set_title(f"{name} ({result['mode']})")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument(
        "--cases",
        nargs="*",
        default=None,
        choices=list(CASES["full"]),
        help="full mode: size presets measured too (default: one per family)",
    )
    parser.add_argument("--codec", default=None, help="acgc's codec (default: its own)")
    parser.add_argument(
        "--target", type=float, default=None, help="acgc's target, its margin (default: its own)"
    )
    parser.add_argument("--plot", default=None, help="write the trade-off plot here (PNG)")
    args = parser.parse_args(argv)
    setup_threads(args)
    options = {"codec": args.codec, "target": args.target}
    args.acgc_options = {k: v for k, v in options.items() if v is not None}
    torch.manual_seed(0)
    cases = [] if args.quick else list(DEFAULT_CASES["full"] if args.cases is None else args.cases)
    models = {name: compare_model(name, args) for name in args.models}
    for name in progress(cases, "size presets"):
        models[name] = compare_model(name, args, case=True)
    result = {
        "benchmark": "acgc_vs_fixed",
        "mode": "quick" if args.quick else "full",
        "machine": machine(resolve_device(args.device)),
        "acgc_options": args.acgc_options,
        "models": models,
    }
    emit(result)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
