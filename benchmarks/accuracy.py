"""Final validation accuracy of each recipe's offline default, plain vs each policy, over
several seeds: mean and spread.

Prints one JSON line. Every run is ``recipes.train.train`` on the composed Hydra config
(``configs/``), one after the other in this process: the same data, model and trainer
for every configuration, only ``compression=`` differs. Per model and configuration:
the final ``val/acc`` and ``val/loss`` of each seed, their mean, sample standard
deviation, min and max, the paired validation-loss difference against plain on the same
seed (same init and data order: its mean and standard error), and the mean of the
compression ratio the callback logged last (``acgc/ratio``).

``--quick``: the ResNet recipe only (ResNet-18 at width 1/8 on digits, 3 epochs), plain
vs acgc and gact. Full: every recipe at its offline default (10 epochs), plain vs acgc
and fixed 2-bit quant, about 15 minutes on 2 CPU cores (every policy, ``--configs plain
acgc gact division comet quant2``, about 30), so that the whole full suite stays near 45
minutes.

    python -m benchmarks.accuracy [--quick] [--seeds 0 1 2] [--models ...] [--configs ...]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks._harness import (
    MODELS,
    SIZES,
    add_common_arguments,
    emit,
    machine,
    resolve_device,
    setup_threads,
)

# compression= overrides of each configuration (see configs/compression/)
COMPRESSION: dict[str, list[str]] = {
    "plain": ["compression=none"],
    "acgc": ["compression=acgc"],
    "gact": ["compression=gact"],
    "division": ["compression=division"],
    "comet": ["compression=comet"],
    "quant2": ["compression=fixed", "compression.codec=quant", "compression.bits=2"],
}
QUIET = [
    "logger=false",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
QUICK_TRAINER = ["trainer.max_epochs=3"]  # as experiment=compare_digits


def base_overrides(model: str, quick: bool, device: str) -> list[str]:
    """The Hydra overrides that every configuration of ``model`` shares."""
    sizes = SIZES["quick" if quick else "full"][model]
    if model == "resnet" and quick:
        sizes = [s for s in sizes if not s.startswith("data.batch_size")]  # keep 64
    out = [*sizes, *QUIET, *(QUICK_TRAINER if quick else [])]
    if device != "auto":
        out.append(f"trainer.accelerator={'gpu' if device.startswith('cuda') else device}")
    return out


def overrides(model: str, config: str, seed: int, quick: bool, device: str) -> list[str]:
    """The Hydra overrides of one run."""
    out = [*base_overrides(model, quick, device), *COMPRESSION[config], f"seed={seed}"]
    if config != "plain":
        out.append("compression.print_table=false")
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(values), 5),
        "std": round(statistics.stdev(values), 5) if len(values) > 1 else 0.0,
        "min": round(min(values), 5),
        "max": round(max(values), 5),
    }


def paired(losses: list[float], plain: list[float]) -> dict[str, float]:
    """Mean and standard error of ``losses - plain``, seed by seed.

    >>> paired([1.0, 2.0, 3.0], [1.0, 1.5, 3.5])
    {'loss_diff': 0.0, 'loss_diff_se': 0.28868}
    """
    diffs = [a - b for a, b in zip(losses, plain, strict=True)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    return {"loss_diff": round(statistics.fmean(diffs), 5), "loss_diff_se": round(se, 5)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser)
    parser.add_argument("--models", nargs="+", choices=MODELS, help="default: all (quick: resnet)")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(COMPRESSION),
        help="default: plain acgc quant2 (quick: plain acgc gact)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args(argv)
    setup_threads(args)
    models = args.models or (["resnet"] if args.quick else list(MODELS))
    configs = args.configs or (
        ["plain", "acgc", "gact"] if args.quick else ["plain", "acgc", "quant2"]
    )
    configs = ["plain", *(c for c in configs if c != "plain")]  # plain first: the pairing

    from recipes.config_schema import compose_config
    from recipes.train import RATIO_KEY, train

    results: dict[str, Any] = {}
    for model in models:
        rows: dict[str, Any] = {}
        plain_losses: list[float] = []
        for config in configs:
            runs = []
            for seed in args.seeds:
                cfg = compose_config(overrides(model, config, seed, args.quick, args.device))
                metrics = train(cfg)
                runs.append(
                    {
                        "seed": seed,
                        "val_acc": metrics.get(cfg.summary_metric, float("nan")),
                        "val_loss": metrics.get("val/loss", float("nan")),
                        "ratio": metrics.get(RATIO_KEY, 1.0),
                        "seconds": metrics["fit_seconds"],
                    }
                )
            accs = [r["val_acc"] for r in runs]
            losses = [r["val_loss"] for r in runs]
            plain_losses = plain_losses or losses
            rows[config] = {
                "val_acc": [round(a, 5) for a in accs],
                **spread(accs),
                "val_loss": [round(v, 5) for v in losses],
                "loss": spread(losses),
                **paired(losses, plain_losses),
                "ratio_mean": round(statistics.fmean(r["ratio"] for r in runs), 3),
                "fit_seconds_mean": round(statistics.fmean(r["seconds"] for r in runs), 1),
            }
        results[model] = {
            "overrides": base_overrides(model, args.quick, args.device),
            "metric": "val/acc",
            "configs": rows,
        }
    result = {
        "benchmark": "accuracy",
        "mode": "quick" if args.quick else "full",
        "machine": machine(resolve_device(args.device)),
        "seeds": args.seeds,
        "models": results,
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
