"""Paired-seed accuracy sweep: plain vs compressed training on every recipe.

For each recipe and each seed, plain training and every compression configuration run
with the SAME seed (same initial weights, same data and data order), so the paired
difference of final validation loss isolates what compression changes. Seeds and
configurations are interleaved (seed-major, the configurations' order rotated per seed)
so that machine load drifting during the sweep hits every configuration alike.

Every run appends one JSON line to ``--out`` (``benchmarks/results/sweep.jsonl``): the
recipe, the configuration, the seed, final ``val/loss``, ``val/acc``, the activation
compression ratio (``acgc/ratio``), the fit time, the commit, the machine and the date.
At the end one summary line is appended (and printed): per recipe and configuration the
mean paired difference of validation loss against plain, plain's seed-to-seed spread
(max - min of its validation losses) and whether the mean difference lies within it.

Configurations are Hydra overrides (``configs/``), one ``--config`` per configuration;
plain (``compression=none``) is always included::

    python -m benchmarks.sweep --recipes charlm --seeds 0 1 2 \\
        --config "compression=fixed compression.bits=2" \\
        --config "compression=acgc compression.gradient_error=0.05"
    python -m benchmarks.sweep --summarize benchmarks/results/sweep.jsonl   # no training

``--plot`` (default ``docs/accuracy_sweep.png``) draws the paired validation-loss
difference against the activation ratio, one marker per configuration and recipe.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import emit, machine, resolve_device

__all__ = [
    "PLAIN",
    "RECIPES",
    "format_table",
    "plot_sweep",
    "read_runs",
    "run_order",
    "summarize",
]

PLAIN = "compression=none"


def _decoder(arch: str, windows: int) -> list[str]:
    """A sweep recipe of ``model=causal_lm``: 4 x 64, the char-LM's text at seq 64, batch
    32, one epoch of ``windows`` windows (``windows / 32`` AdamW steps)."""
    return [
        "model=causal_lm",
        arch,
        "model.hidden_size=64",
        "data.seq_len=64",
        f"data.num_windows={windows}",
        "trainer.max_epochs=1",
    ]


# Hydra overrides of each recipe in the sweep: small enough for about a minute per plain
# run on one shared CPU core, large enough to train to a meaningful loss.
RECIPES: dict[str, list[str]] = {
    # 4 x 64 GPT on pydoc_data text, seq 64, batch 32, 125 AdamW steps (one epoch)
    "charlm": [
        "model=charlm",
        "model.hidden_size=64",
        "data.seq_len=64",
        "data.num_windows=4000",
        "trainer.max_epochs=1",
    ],
    # Hugging Face decoders of the same width and data (model=causal_lm: fused attention),
    # 250 steps: at 125 some seeds still sit on the plateau of single-character guesses
    "llama": _decoder("model.num_kv_heads=2", windows=8000),
    "gpt2": _decoder("model.arch=gpt2", windows=8000),
    # the same, 500 steps: seeds still leave the plateau at 250 at times that move with
    # any rounding (plain's seed 3 ended at 2.94 at commit 31392b1, 2.46 at 42872bd)
    "gpt2_long": _decoder("model.arch=gpt2", windows=16000),
    # ResNet-18 at width 1/8 on digits, batch 64, 3 epochs (as experiment=compare_digits)
    "resnet": ["model=resnet", "model.width=0.125", "trainer.max_epochs=3"],
    # BERT 2 x 64 on the generated marker-order task, 3000 sequences, 3 epochs
    "bert": ["model=bert", "data.num_samples=3000", "trainer.max_epochs=3"],
    # the same, 6 epochs: past the plateau that 3 epochs leave some seeds on
    "bert_long": ["model=bert", "data.num_samples=3000", "trainer.max_epochs=6"],
    # GCN 2 x 64 on the generated SBM graph, 2000 nodes, 3 x 10 full-graph steps
    "gnn": ["model=gnn", "data.num_nodes=2000", "trainer.max_epochs=3"],
}
QUIET = [
    "logger=false",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
FIXED2 = "compression=fixed compression.codec=quant compression.bits=2"
ACGC = "compression=acgc"  # at its default
DESCRIPTIONS = {  # what each of RECIPES trains, in a few words (README's glance)
    "charlm": "char-level GPT 4x64, Python docs text, 125 AdamW steps",
    "resnet": "ResNet-18 (1/8 width), digits, 3 epochs",
    "bert": "BERT 2x64, generated order task, 3 epochs",
    "bert_long": "the same BERT, 6 epochs",
    "gnn": "GCN 2x64, generated 2000-node graph",
    "llama": "Llama decoder 4x64, Python docs text, 250 steps",
    "gpt2": "GPT-2 decoder 4x64, Python docs text, 250 steps",
    "gpt2_long": "the same GPT-2, 500 steps",
}
DEFAULT_CONFIGS = [
    FIXED2,
    "compression=fixed compression.codec=quant compression.bits=4",
    "compression=acgc compression.gradient_error=0.05",
    "compression=acgc compression.gradient_error=0.2",
]


def run_order(
    recipes: Sequence[str], configs: Sequence[str], seeds: Sequence[int]
) -> list[tuple[str, int, str]]:
    """``(recipe, seed, config)`` in the order they run: per recipe, seed-major, the
    configurations rotated by ``seed`` places so none always runs first (also when the
    seeds run in separate processes).

    Example:
        >>> run_order(["r"], ["a", "b"], [0, 1])
        [('r', 0, 'a'), ('r', 0, 'b'), ('r', 1, 'b'), ('r', 1, 'a')]
    """
    out = []
    for recipe in recipes:
        for seed in seeds:
            k = seed % len(configs)
            out += [(recipe, seed, c) for c in [*configs[k:], *configs[:k]]]
    return out


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_one(recipe: str, config: str, seed: int, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Train one recipe with one configuration and seed; the run's result row."""
    from recipes.config_schema import compose_config
    from recipes.train import RATIO_KEY, train

    overrides = [*RECIPES[recipe], *QUIET, *config.split(), *extra, f"seed={seed}"]
    cfg = compose_config(overrides)
    if cfg.compression is not None:
        cfg.compression.print_table = False
    metrics = train(cfg)
    return {
        "kind": "run",
        "recipe": recipe,
        "config": config,
        "seed": seed,
        "val_loss": metrics.get("val/loss", math.nan),
        "val_acc": metrics.get("val/acc", math.nan),
        "ratio": metrics.get(RATIO_KEY, 1.0),
        "fit_seconds": round(metrics["fit_seconds"], 2),
        "overrides": overrides,
    }


def read_runs(path: Path) -> list[dict[str, Any]]:
    """The run rows of a results file (summary lines are skipped)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "run"]


def summarize(runs: Iterable[dict[str, Any]], plain: str = PLAIN) -> dict[str, Any]:
    """Per recipe and configuration: paired validation-loss differences against plain.

    For every seed where both ran, ``val_loss(config) - val_loss(plain)``, against
    plain's run of the same seed in the same sweep (the same commit and machine, else the
    one nearest in time: a CPU of another make trains the same seed to another loss, so
    a row is never paired with a later sweep's plain); reported are their mean (absolute
    and relative to those plain runs' mean loss) and standard error, plain's seed-to-seed
    spread (max - min of the same plain runs) and ``within_spread``: ``|mean difference|
    <= spread``; the fit time against the same plain runs (the same machine load).
    Later runs of the same (recipe, config, seed) replace earlier ones.

    Example:
        >>> runs = [{"recipe": "r", "config": c, "seed": s, "val_loss": v, "val_acc": 0.5,
        ...          "ratio": q, "fit_seconds": 1.0}
        ...         for c, q, vals in [(PLAIN, 1.0, [2.0, 2.2]), ("x", 8.0, [2.1, 2.2])]
        ...         for s, v in enumerate(vals)]
        >>> row = summarize(runs)["r"]["x"]
        >>> row["val_loss_diff_mean"], row["plain_spread"], row["within_spread"]
        (0.05, 0.2, True)
    """
    latest: dict[tuple[str, str, int], dict[str, Any]] = {}
    plain_runs: dict[tuple[str, int], list[dict[str, Any]]] = {}  # every plain run
    for r in runs:
        latest[(r["recipe"], r["config"], r["seed"])] = r
        if r["config"] == plain:
            plain_runs.setdefault((r["recipe"], r["seed"]), []).append(r)
    out: dict[str, Any] = {}
    for recipe in dict.fromkeys(k[0] for k in latest):
        base = {s: r for (rc, c, s), r in latest.items() if rc == recipe and c == plain}
        if not base:
            continue
        rows = {}
        for config in dict.fromkeys(k[1] for k in latest if k[0] == recipe):
            mine = {s: r for (rc, c, s), r in latest.items() if rc == recipe and c == config}
            seeds = sorted(set(mine) & set(base))
            if not seeds:
                continue
            paired = {s: _nearest(plain_runs[(recipe, s)], mine[s]) for s in seeds}
            diffs = [mine[s]["val_loss"] - paired[s]["val_loss"] for s in seeds]
            mean_diff = statistics.fmean(diffs)
            losses = [paired[s]["val_loss"] for s in seeds]  # plain on this row's seeds
            spread, plain_mean = max(losses) - min(losses), statistics.fmean(losses)
            plain_time = statistics.fmean(paired[s]["fit_seconds"] for s in seeds)
            se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
            fit = statistics.fmean(mine[s]["fit_seconds"] for s in seeds)
            rows[config] = {
                "seeds": seeds,
                "val_loss_mean": round(statistics.fmean(mine[s]["val_loss"] for s in seeds), 4),
                "val_acc_mean": round(statistics.fmean(mine[s]["val_acc"] for s in seeds), 4),
                "val_loss_diff": [round(d, 4) for d in diffs],
                "val_loss_diff_mean": round(mean_diff, 4),
                "val_loss_diff_se": None if se is None else round(se, 4),
                "val_loss_diff_rel": round(mean_diff / plain_mean, 4),
                "plain_spread": round(spread, 4),
                "within_spread": abs(mean_diff) <= spread,
                "ratio_mean": round(statistics.fmean(mine[s]["ratio"] for s in seeds), 3),
                "fit_seconds_mean": round(fit, 1),
                "fit_time_vs_plain": round(fit / plain_time, 2),
                "commits": sorted({mine[s].get("commit", "unknown") for s in seeds}),
            }
        out[recipe] = rows
    return out


def _nearest(candidates: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, Any]:
    """The run of ``candidates`` of the same commit and CPU as ``run``, else the one
    nearest in time (the machine's date); the last one where runs carry no date."""

    def cpu(r: dict[str, Any]) -> Any:
        return r.get("machine", {}).get("cpu")

    same = [
        c
        for c in candidates
        if c.get("commit") is not None
        and c.get("commit") == run.get("commit")
        and cpu(c) == cpu(run)
    ]
    if same:
        return same[-1]

    def when(r: dict[str, Any]) -> float:
        date = r.get("machine", {}).get("date")
        return datetime.datetime.fromisoformat(date).timestamp() if date else math.nan

    t = when(run)
    if math.isnan(t):
        return candidates[-1]
    return min(candidates, key=lambda c: abs(when(c) - t) if not math.isnan(when(c)) else math.inf)


def _se(row: dict[str, Any]) -> str:
    se = row.get("val_loss_diff_se")
    return "" if se is None else f" ± {se:.4f}"


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table, one row per recipe and configuration.

    Example:
        >>> row = {"val_loss_mean": 2.1, "val_acc_mean": 0.4, "val_loss_diff_mean": 0.05,
        ...        "val_loss_diff_rel": 0.024, "plain_spread": 0.2, "within_spread": True,
        ...        "ratio_mean": 8.0, "fit_time_vs_plain": 1.5, "seeds": [0, 1],
        ...        "commits": ["abc1234"]}
        >>> print(format_table({"r": {"compression=x": row}}).splitlines()[2])
        | r | x | 2 | 2.1000 | +0.0500 (+2.4%) | 0.2000 | yes | 8.00x | 0.400 | 1.50x | abc1234 |
    """
    lines = [
        "| recipe | configuration | seeds | val loss | paired diff vs plain (± s.e.) "
        "| plain spread | within | ratio | val acc | fit time vs plain | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for recipe, rows in summary.items():
        for config, r in rows.items():
            name = config.replace("compression.", "").replace("compression=", "")
            lines.append(
                f"| {recipe} | {name} | {len(r['seeds'])} | {r['val_loss_mean']:.4f} "
                f"| {r['val_loss_diff_mean']:+.4f} ({100 * r['val_loss_diff_rel']:+.1f}%)"
                f"{_se(r)} "
                f"| {r['plain_spread']:.4f} | {'yes' if r['within_spread'] else 'no'} "
                f"| {r['ratio_mean']:.2f}x | {r['val_acc_mean']:.3f} "
                f"| {r['fit_time_vs_plain']:.2f}x | {', '.join(r.get('commits', ['unknown']))} |"
            )
    return "\n".join(lines)


def plot_sweep(summary: dict[str, Any], path: Path, plain: str = PLAIN) -> Path:
    """Paired validation-loss difference (relative to plain) against the activation
    ratio: one marker per configuration, one colour per recipe; the band is plain's
    seed-to-seed spread of each recipe (relative), the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    markers = "osD^vP*Xh"
    configs = list(dict.fromkeys(c for rows in summary.values() for c in rows if c != plain))
    for i, (recipe, rows) in enumerate(summary.items()):
        colour = f"C{i}"
        base = rows.get(plain)
        if base:
            half = 100 * base["plain_spread"] / base["val_loss_mean"]  # in % like y
            ax.axhspan(-half, half, color=colour, alpha=0.08)
        for config, row in rows.items():
            if config == plain:
                continue
            ax.scatter(
                row["ratio_mean"],
                100 * row["val_loss_diff_rel"],
                color=colour,
                marker=markers[configs.index(config) % len(markers)],
                s=60,
                label=f"{recipe}: {config.replace('compression=', '').replace('compression.', '')}",
            )
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("activation compression ratio (acgc/ratio)")
    ax.set_ylabel("paired val-loss difference vs plain (%)")
    ax.set_title("Paired-seed accuracy sweep (bands: plain's seed-to-seed spread)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=["charlm"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--config",
        action="append",
        dest="configs",
        help="Hydra overrides of one configuration, quoted; repeat (default: fixed 2 and "
        "4 bit, acgc at e=0.05 and 0.2)",
    )
    parser.add_argument("--extra", default="", help="Hydra overrides added to every run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sweep.jsonl"))
    parser.add_argument("--plot", type=Path, default=Path("docs/accuracy_sweep.png"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--resume", action="store_true", help="skip the runs --out already holds")
    parser.add_argument("--summarize", type=Path, help="summarize this results file, train nothing")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    info = {"commit": _commit(), "machine": machine(resolve_device("cpu"))}
    if args.summarize:
        runs = read_runs(args.summarize)
    else:
        configs = [PLAIN, *[c for c in (args.configs or DEFAULT_CONFIGS) if c != PLAIN]]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        runs = read_runs(args.out) if args.resume and args.out.exists() else []
        done = {(r["recipe"], r["config"], r["seed"]) for r in runs}
        for recipe, seed, config in run_order(args.recipes, configs, args.seeds):
            if (recipe, config, seed) in done:
                continue
            row = {**run_one(recipe, config, seed, args.extra.split()), **info}
            runs.append(row)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"sweep: {recipe} seed {seed} [{config}] val/loss={row['val_loss']:.4f} "
                  f"ratio={row['ratio']:.2f} {row['fit_seconds']:.0f} s", flush=True)  # fmt: skip
    summary = summarize(runs)
    result = {"kind": "summary", "benchmark": "sweep", **info, "summary": summary,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
    if not args.summarize:
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    if args.plot:  # every configuration the results file holds, not only this run's
        plot_sweep(summary if args.summarize else summarize(read_runs(args.out)), args.plot)
    print(format_table(summary))
    emit(result)
    return result


if __name__ == "__main__":
    main()
