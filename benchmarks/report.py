"""Plots in ``docs/`` and the results table in ``README.md`` from ``benchmarks/results/``.

Reads the JSON lines that ``python -m benchmarks.run_all`` wrote and

- draws ``docs/memory_sites.png`` (ResNet recipe with acgc: MB per saved-tensor site
  before and after compression), ``docs/tradeoff.png`` (compression ratio vs measured
  gradient error for each allowed error e), ``docs/bound_trajectory.png`` (acgc's mean
  log10 error bound, measured gradient error and ratio per calibration step of a short
  training run) and ``docs/memory_time.png`` (kept activation memory vs step time,
  every configuration, relative to plain training);
- replaces what is between ``<!-- results:start -->`` and ``<!-- results:end -->`` in
  README.md with the tables, the machine and command they come from, and which of the
  project's bars the numbers meet and where they fall short.

    python -m benchmarks.report [--mode auto|quick|full] [--readme README.md]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
START, END = "<!-- results:start -->", "<!-- results:end -->"
BENCHMARKS = ("memory", "speed", "accuracy", "batch", "tradeoff")
MB = 2**20

# The project's bars (README / issue 8), measured on CPU.
RATIO_BAR = 20.0  # activation ratio on the ResNet recipe
ACCURACY_BAR_PP = 0.1  # accuracy within 0.1 pp of plain, or within plain's seed spread
TIME_BAR = 1.25  # step time relative to plain, CPU
BAR_POLICY = "acgc"

LABELS = {
    "plain": "plain",
    "checkpoint": "checkpoint",
    "acgc": "acgc (e=0.05)",
    "gact": "gact (2 bits avg)",
    "division": "division",
    "comet": "comet (rel 0.01)",
    "quant2": "fixed quant 2-bit",
}
MODEL_NAMES = {"resnet": "ResNet", "bert": "BERT", "gnn": "GNN"}


# ----------------------------------------------------------------------------- loading
def load(mode: str, results: Path = RESULTS) -> tuple[str, dict[str, dict[str, Any]]]:
    """The mode used and, per benchmark, its result line of that mode.

    ``auto``: ``full`` when the memory benchmark has a full line, else ``quick``.
    """
    lines: dict[str, list[dict[str, Any]]] = {}
    for name in BENCHMARKS:
        path = results / f"{name}.jsonl"
        text = path.read_text() if path.exists() else ""
        lines[name] = [json.loads(line) for line in text.splitlines() if line.strip()]
    if mode == "auto":
        has_full = any(r.get("mode") == "full" for r in lines["memory"])
        mode = "full" if has_full else "quick"
    chosen = {}
    for name, rows in lines.items():
        found = [r for r in rows if r.get("mode") == mode]
        if found:
            chosen[name] = found[-1]
    return mode, chosen


# ----------------------------------------------------------------------------- plots
def _short(key: str) -> str:
    return key.removeprefix("net.").removeprefix("bert.")


def plot_sites(memory: dict[str, Any], path: Path, model: str = "resnet") -> Path | None:
    sites = memory["models"].get(model, {}).get("sites", {}).get(BAR_POLICY)
    if not sites:
        return None
    rows = [s for s in sites if s["raw_bytes"] >= 4096]  # leave out tiny and shared sites
    row = memory["models"][model]["configs"][BAR_POLICY]
    height = max(4.0, 0.22 * len(rows) + 1.5)
    fig, ax = plt.subplots(figsize=(9, height))
    y = list(range(len(rows)))
    before = [s["raw_bytes"] / MB for s in rows]
    after = [s["packed_bytes"] / MB for s in rows]
    ax.barh([v + 0.2 for v in y], before, height=0.4, color="#bbbbbb", label="saved (plain)")
    ax.barh([v - 0.2 for v in y], after, height=0.4, color="#1f5fa8", label="kept (acgc)")
    ax.set_yticks(y)
    ax.set_yticklabels([f"{_short(s['key'])} ({s['module_type']})" for s in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("MB per training step")
    ax.set_title(
        f"{memory['models'][model]['description']}, acgc e=0.05: saved activations per site\n"
        f"{row['saved_mb']:.1f} MB -> {row['kept_mb']:.1f} MB ({row['ratio']:.1f}x); sites "
        f"under 4 KB and tensors shared with an earlier site left out",
        fontsize=9,
    )
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tradeoff(tradeoff: dict[str, Any], path: Path) -> Path:
    rows = tradeoff["tradeoff"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in rows:
        e, err, ratio = r["gradient_error"], r["grad_error"], r["ratio"]
        ax.plot([err, e], [ratio, ratio], color="#999999", lw=0.8, zorder=1)
        ax.scatter([e], [ratio], facecolors="none", edgecolors="#d62728", s=40, zorder=2)
        ax.scatter([err], [ratio], color="#1f5fa8", s=40, zorder=3)
        ax.annotate(f"e={e:g}", (err, ratio), textcoords="offset points", xytext=(-8, 7))
    ax.scatter([], [], color="#1f5fa8", label="measured ‖ĝ−g‖/‖g‖ (median)")
    ax.scatter([], [], facecolors="none", edgecolors="#d62728", label="allowed error e")
    ax.set_xscale("log")
    ax.set_xlabel("relative gradient error")
    ax.set_ylabel("activation compression ratio (x)")
    ax.set_title(f"acgc trade-off: {tradeoff['model']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_trajectory(tradeoff: dict[str, Any], path: Path) -> Path:
    traj = tradeoff["trajectory"]
    cal = traj["calibrations"]
    fig, axes = plt.subplots(3, 1, figsize=(6.5, 7), sharex=True)
    with_bound = [c for c in cal if "log10_bound" in c]
    axes[0].plot([c["step"] for c in with_bound], [c["log10_bound"] for c in with_bound], "o-")
    axes[0].set_ylabel("mean log10 bound")
    axes[1].plot([c["step"] for c in cal], [c["grad_error"] for c in cal], "o-", label="measured")
    axes[1].axhline(traj["gradient_error"], color="#d62728", ls="--", label="allowed e")
    axes[1].set_ylabel("‖ĝ−g‖/‖g‖")
    axes[1].legend(fontsize=8)
    axes[2].plot([c["step"] for c in cal], [c["ratio"] for c in cal], "o-", color="#2ca02c")
    axes[2].set_ylabel("ratio (x)")
    axes[2].set_xlabel("training step (calibration steps)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"acgc over {traj['steps']} training steps, calibrating every "
        f"{traj['calibrate_every']} (first 3 all)\n{tradeoff['model']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory_time(memory: dict[str, Any], speed: dict[str, Any], path: Path) -> Path | None:
    models = [m for m in memory["models"] if m in speed["models"]]
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4.4), squeeze=False)
    markers = dict(zip(LABELS, "o^sDvP*X", strict=False))
    colors = dict(zip(LABELS, plt.get_cmap("tab10").colors, strict=False))
    for ax, model in zip(axes[0], models, strict=True):
        mem = memory["models"][model]["configs"]
        plain = mem["plain"]["kept_bytes"]
        for config, row in speed["models"][model]["configs"].items():
            if config not in mem:
                continue
            ax.scatter(
                [row["vs_plain"]],
                [mem[config]["kept_bytes"] / plain],
                marker=markers[config],
                color=colors[config],
                s=45,
                label=LABELS[config],
            )
        ax.axvline(TIME_BAR, color="#999999", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("step time vs plain")
        ax.set_ylabel("activations kept vs plain")
        ax.set_title(memory["models"][model]["description"], fontsize=8)
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(
        "memory and time per configuration, relative to plain training (dotted: the 1.25x "
        "time bar; lower left is better)",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- tables
def _machine(m: dict[str, Any]) -> str:
    text = (
        f"{m['cpu']}, {m['cpu_count']} cores, {m['platform']}, Python {m['python']}, "
        f"torch {m['torch']}, {m['threads']} thread(s), device {m['device']}"
    )
    if "gpu" in m:
        text += f" ({m['gpu']})"
    text += f", {m['date'][:10]}"
    if "load_avg_1m" in m:
        text += f"; load average {m['load_avg_1m']:g} when the memory benchmark started"
    return text


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def memory_time_table(memory: dict[str, Any] | None, speed: dict[str, Any] | None) -> list[str]:
    if memory is None and speed is None:
        return ["(memory and speed: not run)"]
    source = memory or speed
    out = [
        "| model | configuration | activations saved → kept (MB) | ratio | step peak (MB) "
        "| step time vs plain | gradient error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, info in source["models"].items():
        mem = (memory or {}).get("models", {}).get(model, {}).get("configs", {})
        spd = (speed or {}).get("models", {}).get(model, {}).get("configs", {})
        first = True
        for config in LABELS:
            if config not in mem and config not in spd:
                continue
            m, s = mem.get(config, {}), spd.get(config, {})
            name, first = (info["description"] if first else ""), False
            kept = f"{m['saved_mb']:.2f} → {m['kept_mb']:.2f}" if "kept_mb" in m else "–"
            peak = _fmt(m.get("rss_step_peak_mb", m.get("cuda_step_peak_mb")), ".1f")
            out.append(
                f"| {name} | {LABELS[config]} | {kept} | "
                f"{_fmt(m.get('ratio'), '.1f', 'x')} | {peak} | "
                f"{_fmt(s.get('vs_plain'), '.2f', 'x')} | {_fmt(m.get('grad_error'), '.3f')} |"
            )
    return out


def accuracy_table(accuracy: dict[str, Any] | None) -> list[str]:
    if accuracy is None:
        return ["(accuracy: not run)"]
    n = len(accuracy["seeds"])
    out = [
        f"| model | configuration | val acc, {n} seeds: mean ± std [min, max] | vs plain "
        f"(pp) | ratio (acgc/ratio) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for model, info in accuracy["models"].items():
        plain = info["configs"]["plain"]["mean"]
        for i, (config, r) in enumerate(info["configs"].items()):
            delta = 100 * (r["mean"] - plain)
            out.append(
                f"| {MODEL_NAMES.get(model, model) if i == 0 else ''} | "
                f"{LABELS.get(config, config)} | {100 * r['mean']:.2f} ± {100 * r['std']:.2f} "
                f"[{100 * r['min']:.2f}, {100 * r['max']:.2f}] | {delta:+.2f} | "
                f"{r['ratio_mean']:.1f}x |"
            )
    out.append("")
    out += [
        f"{MODEL_NAMES.get(model, model)}: `python recipes/train.py {' '.join(info['overrides'])}"
        f" compression=<configuration> seed=<seed>`"
        for model, info in accuracy["models"].items()
    ]
    return out


def batch_table(batch: dict[str, Any] | None) -> list[str]:
    if batch is None:
        return ["(batch: not run)"]
    configs = sorted(
        {c for m in batch["models"].values() for c in m["configs"]}, key=list(LABELS).index
    )
    out = [
        "| model | budget (MB) | plain | " + " | ".join(LABELS[c] for c in configs) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in configs) + " |",
    ]
    for info in batch["models"].values():
        plain = next(iter(info["configs"].values()))["batch_size_uncompressed"]
        cells = []
        for config in configs:
            r = info["configs"].get(config)
            cap = " (data cap)" if r and r["capped_by_data"] else ""
            cells.append(f"{r['batch_size']} ({r['gain']:g}x){cap}" if r else "–")
        out.append(
            f"| {info['description']} | {info['budget_mb']:.1f} | {plain} | "
            + " | ".join(cells)
            + " |"
        )
    return out


def tradeoff_table(tradeoff: dict[str, Any] | None) -> list[str]:
    if tradeoff is None:
        return ["(tradeoff: not run)"]
    out = [
        "| allowed error e | measured error: median (max) | within e | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for r in tradeoff["tradeoff"]:
        out.append(
            f"| {r['gradient_error']:g} | {r['grad_error']:.4f} ({r['grad_error_max']:.4f}) | "
            f"{100 * r['within']:.0f}% of {r['steps']} steps | {r['ratio']:.2f}x |"
        )
    return out


# ----------------------------------------------------------------------------- bars
def bars(results: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The project's bars, checked against the numbers: (met, not met) lines."""
    met: list[str] = []
    short: list[str] = []
    memory, speed = results.get("memory"), results.get("speed")
    accuracy, tradeoff = results.get("accuracy"), results.get("tradeoff")

    def verdict(ok: bool, text: str) -> None:
        (met if ok else short).append(text)

    if memory and "resnet" in memory["models"]:
        r = memory["models"]["resnet"]["configs"].get(BAR_POLICY)
        if r:
            verdict(
                r["ratio"] >= RATIO_BAR,
                f"activation ratio on the ResNet recipe ({BAR_POLICY}): {r['ratio']:.1f}x "
                f"(bar ≥ {RATIO_BAR:g}x)",
            )
    if accuracy:
        for model, info in accuracy["models"].items():
            plain, r = info["configs"]["plain"], info["configs"].get(BAR_POLICY)
            if r is None:
                continue
            delta = 100 * (r["mean"] - plain["mean"])
            verdict(
                delta >= -ACCURACY_BAR_PP or plain["min"] <= r["mean"] <= plain["max"],
                f"accuracy of {MODEL_NAMES.get(model, model)} with {BAR_POLICY}: {delta:+.2f} pp "
                f"vs plain (bar: ≥ −{ACCURACY_BAR_PP:g} pp, or within plain's seed range "
                f"[{100 * plain['min']:.2f}, {100 * plain['max']:.2f}]%)",
            )
    if speed:
        on_cpu = speed["machine"]["device"] == "cpu"
        for model, info in speed["models"].items():
            c = info["configs"]
            if BAR_POLICY not in c:
                continue
            t = c[BAR_POLICY]["vs_plain"]
            if on_cpu:
                verdict(
                    t <= TIME_BAR,
                    f"step time of {MODEL_NAMES.get(model, model)} with {BAR_POLICY}: "
                    f"{t:.2f}x plain (bar ≤ {TIME_BAR:g}x on CPU)",
                )
            if "checkpoint" in c and memory and model in memory["models"]:
                mem = memory["models"][model]["configs"]
                ck_time = c["checkpoint"]["vs_plain"]
                ck_mem, own = mem["checkpoint"]["kept_mb"], mem[BAR_POLICY]["kept_mb"]
                verdict(
                    t < ck_time and own <= ck_mem,
                    f"{MODEL_NAMES.get(model, model)}, {BAR_POLICY} vs checkpointing: "
                    f"{t:.2f}x vs {ck_time:.2f}x step time, {own:.2f} vs {ck_mem:.2f} MB kept "
                    f"(bar: faster at equal or less memory)",
                )
    if tradeoff:
        broken = [r for r in tradeoff["tradeoff"] if r["grad_error_max"] > r["gradient_error"]]
        verdict(
            not broken,
            "acgc's promise, measured error ≤ e on every verified step: "
            + (
                "kept for every e"
                if not broken
                else "broken for e = " + ", ".join(f"{r['gradient_error']:g}" for r in broken)
            ),
        )
    return met, short


def notes(memory: dict[str, Any] | None) -> list[str]:
    """Oddities in the numbers worth a line: the meter counting more saved bytes under
    compression than plain training saves (one tensor packed more than once)."""
    out = []
    for model, info in (memory or {}).get("models", {}).items():
        over = {
            config: r
            for config, r in info["configs"].items()
            if r.get("meter_saved_bytes", 0) > 1.01 * r["saved_bytes"]
        }
        if not over:
            continue
        worst = max(over.values(), key=lambda r: r["meter_saved_bytes"])
        factor = worst["meter_saved_bytes"] / worst["saved_bytes"]
        out.append(
            f"{MODEL_NAMES.get(model, model)} ({', '.join(over)}): under compression the "
            f"meter counts up to {worst['meter_saved_bytes'] / MB:.2f} MB saved against "
            f"{worst['saved_mb']:.2f} MB in plain training (some tensor is packed more than "
            f"once), so the logged `acgc/ratio` overstates the ratio against plain training "
            f"by up to {factor:.2f}x; the table divides by the plain bytes"
        )
    return out


# ----------------------------------------------------------------------------- README
def markdown(mode: str, results: dict[str, dict[str, Any]], plots: list[str]) -> str:
    first = next(iter(results.values()))
    command = (
        "python -m benchmarks.run_all --quick"
        if mode == "quick"
        else "python -m benchmarks.run_all"
    )
    lines = [
        f"Measured on {_machine(first['machine'])}.",
        f"Command: `{command} && python -m benchmarks.report` ({mode} mode"
        + (
            ": small models, few steps and seeds; a smoke test of the numbers, not a final verdict"
            if mode == "quick"
            else ""
        )
        + ").",
        "",
        "**Memory and time of one training step.** Activations saved → kept: the engine's "
        "meter (policies measured on the step after their calibration; checkpointing: "
        "what autograd keeps plus the block inputs). Step peak: growth of the process's "
        "RSS during one step, in a child process per configuration (CUDA: max allocated). "
        "Step time: forward + backward, median over interleaved rounds. Gradient error: "
        "measured ‖ĝ − g‖/‖g‖ on the last calibration step.",
        "",
        *memory_time_table(results.get("memory"), results.get("speed")),
        "",
        "**Accuracy** (final validation accuracy, %):",
        "",
        *accuracy_table(results.get("accuracy")),
        "",
        "**Largest batch under one memory budget** (Lightning's tuner, "
        + (results["batch"]["search"] if "batch" in results else "–")
        + " search; plain = identity codec under the same accounting):",
        "",
        *batch_table(results.get("batch")),
        "",
        "**acgc's trade-off on the ResNet recipe** (verified on every step):",
        "",
        *tradeoff_table(results.get("tradeoff")),
        "",
    ]
    met, short = bars(results)
    lines.append("**Where we fall short** (the project's bars, checked against these numbers):")
    lines.append("")
    lines += [f"- not met: {s}" for s in short] or ["- nothing: every bar is met"]
    lines += [f"- met: {s}" for s in met]
    lines += [f"- note: {s}" for s in notes(results.get("memory"))]
    if plots:
        lines += [
            "",
            "Plots: "
            + ", ".join(f"[{Path(p).stem}]({p})" for p in plots)
            + " (see also `docs/benchmarks.md`).",
        ]
    return "\n".join(lines)


def write_readme(readme: Path, text: str) -> None:
    """Replace what is between the results markers; raise if they are missing."""
    content = readme.read_text()
    start, end = content.find(START), content.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{readme} has no {START} ... {END} markers")
    readme.write_text(content[: start + len(START)] + "\n" + text + "\n" + content[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("auto", "quick", "full"), default="auto")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--docs", type=Path, default=DOCS)
    args = parser.parse_args(argv)
    mode, results = load(args.mode)
    if not results:
        raise SystemExit(f"no {mode} results in {RESULTS}: run python -m benchmarks.run_all")
    args.docs.mkdir(parents=True, exist_ok=True)
    plots: list[Path | None] = []
    if "memory" in results:
        plots.append(plot_sites(results["memory"], args.docs / "memory_sites.png"))
    if "memory" in results and "speed" in results:
        plots.append(
            plot_memory_time(results["memory"], results["speed"], args.docs / "memory_time.png")
        )
    if "tradeoff" in results:
        plots.append(plot_tradeoff(results["tradeoff"], args.docs / "tradeoff.png"))
        plots.append(plot_trajectory(results["tradeoff"], args.docs / "bound_trajectory.png"))
    drawn = [p for p in plots if p is not None]
    links = [Path(os.path.relpath(p, args.readme.resolve().parent)).as_posix() for p in drawn]
    write_readme(args.readme, markdown(mode, results, links))
    for p in drawn:
        print(f"wrote {p}")
    print(f"wrote the {mode} results table into {args.readme}")


if __name__ == "__main__":
    main()
