"""Plots in ``docs/`` and the results section of ``README.md`` from ``benchmarks/results/``.

The one source of the numbers is the JSON lines that ``python -m benchmarks.run_all``
wrote (one line per benchmark and mode, with the machine, commit and date). This script

- draws, from the main mode's results (``full`` when the memory benchmark has a full
  line, else ``quick``): ``docs/memory_time.png`` (step peak memory vs step time per
  configuration, the Pareto front), ``docs/policy_error.png`` (activation ratio vs
  measured gradient error per policy), ``docs/timeline.png`` (memory during one step,
  plain vs compressed), ``docs/memory_sites.png`` (acgc's bytes per saved-tensor site),
  ``docs/tradeoff.png`` and ``docs/bound_trajectory.png`` (acgc over e and over a run),
  ``docs/acgc_vs_fixed.png`` (ratio vs measured error: fixed settings, gact, acgc);
- replaces what is between ``<!-- results:start -->`` and ``<!-- results:end -->`` in
  README.md with :func:`render`: the tables, each labelled with its mode, the machine
  and command, full-size figures beside the quick ones, and the project's bars;
- and what is between ``<!-- glance:start -->`` and ``<!-- glance:end -->`` with
  :func:`render_glance` (``benchmarks/_glance.py``): acgc, checkpointing and fixed 2-bit
  side by side at full size, and the sweep's paired-seed fits.

``tests/test_readme_results.py`` fails when either section differs from what the
committed results render.

    python -m benchmarks.report [--mode auto|quick|full]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import _plots
from benchmarks._acgc_tables import acgc_vs_fixed_bars, acgc_vs_fixed_table
from benchmarks._codec_tables import backends_table, codec_bars, codecs_table
from benchmarks._fit_tables import fit_time_bars, fit_time_table
from benchmarks._glance import glance_section
from benchmarks._gpu_tables import gpu_section, is_gpu_line
from benchmarks._margin_tables import margin_table
from benchmarks._precision_tables import precision_table
from benchmarks._tables import (
    accuracy_table,
    bars,
    batch_table,
    family_table,
    machine_line,
    memory_time_table,
    notes,
    peak_notes,
    tradeoff_table,
)
from benchmarks.run_all import BENCHMARKS as RUN_BY_DEFAULT

ROOT = Path(__file__).resolve().parent.parent
README_PATH = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
START, END = "<!-- results:start -->", "<!-- results:end -->"
GLANCE = ("<!-- glance:start -->", "<!-- glance:end -->")
# the benchmarks whose lines README is made from: the ones run_all runs by default
BENCHMARKS = RUN_BY_DEFAULT
MODES = ("quick", "full")

Results = dict[str, dict[str, Any]]
# file name in docs/, the benchmarks it needs, how it is drawn
PLOTS: list[tuple[str, tuple[str, ...], Callable[[Results, Path], Path | None]]] = [
    (
        "memory_time.png",
        ("memory", "speed"),
        lambda r, p: _plots.plot_memory_time(r["memory"], r["speed"], p),
    ),
    ("policy_error.png", ("memory",), lambda r, p: _plots.plot_policy_error(r["memory"], p)),
    ("timeline.png", ("memory",), lambda r, p: _plots.plot_timeline(r["memory"], p)),
    ("memory_sites.png", ("memory",), lambda r, p: _plots.plot_sites(r["memory"], p)),
    ("tradeoff.png", ("tradeoff",), lambda r, p: _plots.plot_tradeoff(r["tradeoff"], p)),
    ("bound_trajectory.png", ("tradeoff",), lambda r, p: _plots.plot_trajectory(r["tradeoff"], p)),
    ("acgc_vs_fixed.png", ("acgc_vs_fixed",), lambda r, p: _plot_acgc_vs_fixed(r, p)),
]


def _plot_acgc_vs_fixed(results: Results, path: Path) -> Path:
    from benchmarks.acgc_vs_fixed import plot

    plot(results["acgc_vs_fixed"], str(path))
    return path


# ----------------------------------------------------------------------------- loading
def load_all(results: Path = RESULTS) -> dict[str, Results]:
    """Per mode, per benchmark: the last CPU result line of that mode."""
    out: dict[str, Results] = {mode: {} for mode in MODES}
    for name in BENCHMARKS:
        path = results / f"{name}.jsonl"
        text = path.read_text() if path.exists() else ""
        for line in text.splitlines():
            if line.strip():
                row = json.loads(line)
                if is_gpu_line(row):  # the GPU section reads these
                    continue
                out.setdefault(row.get("mode", "quick"), {})[name] = row
    return out


def main_mode(everything: dict[str, Results], mode: str = "auto") -> str:
    """``auto``: ``full`` when the memory benchmark has a full line, else ``quick``."""
    if mode != "auto":
        return mode
    return "full" if "memory" in everything.get("full", {}) else "quick"


def chosen(everything: dict[str, Results], mode: str) -> Results:
    """Each benchmark's line of ``mode``, or of the other mode where it has none."""
    other = "quick" if mode == "full" else "full"
    return {
        name: everything[mode].get(name) or everything[other][name]
        for name in BENCHMARKS
        if name in everything[mode] or name in everything[other]
    }


# ----------------------------------------------------------------------------- README
def _label(result: dict[str, Any]) -> str:
    mode = result.get("mode", "quick")
    detail = "small models: a smoke test, not a verdict" if mode == "quick" else "size presets"
    note = f"; {result['note']}" if result.get("note") else ""
    return f"*{mode} mode* ({detail}; commit {result.get('commit', 'unknown')}{note})"


def _speed_commit(memory: dict[str, Any] | None, speed: dict[str, Any] | None) -> str:
    """Where the step times come from another commit than the memory columns: which."""
    if not (memory and speed) or speed.get("commit") == memory.get("commit"):
        return ""
    note = f"; {speed['note']}" if speed.get("note") else ""
    return f" (step times: commit {speed.get('commit', 'unknown')}{note})"


def _section(title: str, result: dict[str, Any] | None, table: list[str]) -> list[str]:
    label = f", {_label(result)}" if result else ""
    return [f"**{title}**{label}:", "", *table, ""]


def sweep_section(results: Path = RESULTS) -> list[str]:
    """The paired-seed sweep's summary, made from its run lines
    (``benchmarks/results/sweep.jsonl``)."""
    from benchmarks.sweep import format_table, read_runs, summarize

    path = results / "sweep.jsonl"
    runs = read_runs(path) if path.exists() else []
    if not runs:
        return []
    last = runs[-1]["machine"]
    others = {r["machine"].get("cpu", "?") for r in runs if "machine" in r} - {last.get("cpu")}
    label = f"the commit of each row's runs in its last column, {machine_line(last)}"
    if others:  # (each row is paired with plain's runs of its own sweep)
        label += f"; rows of earlier commits also ran on {', '.join(sorted(others))}"
    return _section(
        "Paired-seed accuracy sweep: final validation loss, compressed minus plain on the "
        f"same seed, against plain's seed-to-seed spread ({label})",
        None,
        [
            *format_table(summarize(runs)).splitlines(),
            "",
            "Each run line in `benchmarks/results/sweep.jsonl` holds its Hydra overrides "
            "(`python -m benchmarks.sweep`); `--summarize benchmarks/results/sweep.jsonl` "
            "prints this table again."
            + (
                " The ratio of a `checkpoint_modules` row is the callback's `acgc/ratio`: "
                "against what autograd saves with those blocks checkpointed (against "
                "plain: the memory table's `acgc + checkpoint` rows)."
                if any("checkpoint_modules" in r["config"] for r in runs)
                else ""
            ),
        ],
    )


def render(results: Path = RESULTS, mode: str = "auto") -> str:
    """README's results section, made from the result lines alone (nothing is written)."""
    everything = load_all(results)
    mode = main_mode(everything, mode)
    picked = chosen(everything, mode)
    if not picked:
        return "No results in `benchmarks/results/`: run `python -m benchmarks.run_all`."
    memory, speed = picked.get("memory"), picked.get("speed")
    first = memory or next(iter(picked.values()))
    flag = "--quick" if mode == "quick" else "--full"
    lines = [
        "<!-- generated by `python -m benchmarks.report` from benchmarks/results/*.jsonl: "
        "do not edit by hand -->",
        f"Measured on {machine_line(first['machine'])}.",
        f"Command: `python -m benchmarks.run_all {flag} && python -m benchmarks.report`. "
        "Each table says the mode it comes from.",
        "",
        "Activations saved → kept: the engine's meter (policies after their calibration "
        "steps; checkpointing: what autograd keeps plus the block inputs). Step peak: the "
        "growth of the process's memory during one step (RSS of a child process per "
        "configuration on CPU, `max_memory_allocated` on CUDA), and in brackets plain's "
        "peak less the activation bytes the configuration no longer keeps. Step time: "
        "forward + backward, median ratio to plain over interleaved rounds. Gradient error: "
        "‖ĝ − g‖/‖g‖ of one step against the exact gradient of the same batch.",
        "",
        *_section(
            "Memory and time of one training step" + _speed_commit(memory, speed),
            memory or speed,
            memory_time_table(memory, speed),
        ),
    ]
    lines += _section(
        "acgc's fit time beside plain training (`benchmarks/fit_time.py`: the two alone in "
        "the process, alternating step by step, each step with the recipe's optimizer step; "
        "calibration steps at the fit's schedule)",
        picked.get("fit_time"),
        fit_time_table(picked.get("fit_time")),
    )
    causal = picked.get("causal_lm")
    lines += _section(
        "Hugging Face causal language models, side by side (`benchmarks/causal_lm.py`: "
        "the memory and step-time measurements above, on GPT-2 and Llama decoders; "
        "checkpointing wraps each decoder layer)",
        causal,
        memory_time_table(causal["memory"], causal["speed"])
        if causal
        else ["(causal_lm: not run)"],
    )
    runs = {
        m: (everything[m]["memory"], everything[m].get("speed"))
        for m in ("full", "quick")
        if "memory" in everything[m]
    }
    if runs:
        lines += _section(
            "The best policy per model, full sizes beside quick ones", None, family_table(runs)
        )
    lines += _section(
        "Accuracy (final validation accuracy, %, and validation loss, paired by seed)",
        picked.get("accuracy"),
        accuracy_table(picked.get("accuracy")),
    )
    lines += sweep_section(results)
    batch = picked.get("batch")
    search = f" ({batch['search']} search)" if batch else ""
    lines += _section(
        f"Largest batch under one memory budget{search}; plain = identity "
        "codec under the same accounting",
        batch,
        batch_table(batch),
    )
    lines += _section(
        "acgc's trade-off on the ResNet recipe",
        picked.get("tradeoff"),
        tradeoff_table(picked.get("tradeoff")),
    )
    fixed_runs = {
        m: everything[m]["acgc_vs_fixed"]
        for m in ("full", "quick")
        if "acgc_vs_fixed" in everything[m]
    }
    lines += _section(
        "acgc at each fixed setting's own gradient error (one measured step after "
        "the calibration steps, exact gradient of the same batch; `benchmarks/acgc_vs_fixed.py`)",
        None,
        acgc_vs_fixed_table(fixed_runs),
    )
    lines += _section(
        "acgc's margin (`target`, the share of e² each allocation aims at): its share of "
        "each fixed setting's ratio at that setting's error on the quick models, its "
        "default's ratio, and the verified calibrations of whole fits (the sweep's recipes "
        "at the default e) that kept the promise (`benchmarks/margin.py`)",
        picked.get("margin"),
        margin_table(picked.get("margin")),
    )
    lines += _section(
        "acgc in bf16-mixed training beside float32, at the same weights and batch: bytes "
        "saved and held, the last calibration's κ and rounding floor, and one ordinary "
        "step's gradient error against its own precision's exact gradient and against "
        "float32's (`benchmarks/precision.py`)",
        picked.get("precision"),
        precision_table(picked.get("precision")),
    )
    lines += _section(
        "Codec speed: encode and decode as a multiple of `x.clone()` of the same tensor",
        picked.get("codecs"),
        codecs_table(picked.get("codecs")),
    )
    lines += _section(
        "The CPU codecs' technology: one 2-bit quant encode written each way, side by side "
        "(`benchmarks/cpu_backends.py`)",
        picked.get("cpu_backends"),
        backends_table(picked.get("cpu_backends")),
    )
    met, short = bars(picked)
    codec_met, codec_short = codec_bars(picked.get("codecs"))
    fixed_met, fixed_short = acgc_vs_fixed_bars(fixed_runs)
    fit_met, fit_short = fit_time_bars(picked.get("fit_time"))
    met = met + fit_met + codec_met + fixed_met
    short = short + fit_short + codec_short + fixed_short
    lines += [f"**Where we fall short** (the project's bars, {mode} mode):", ""]
    lines += [f"- not met: {s}" for s in short] or ["- nothing: every bar is met"]
    lines += [f"- met: {s}" for s in met]
    lines += [f"- note: {s}" for s in [*peak_notes(memory), *notes(memory)]]
    links = [
        f"[{name.removesuffix('.png')}](docs/{name})"
        for name, needs, _ in PLOTS
        if all(n in picked for n in needs)
    ]
    if links:
        lines += [
            "",
            f"Plots ({mode} mode): " + ", ".join(links) + " (see also `docs/benchmarks.md`).",
        ]
    gpu = gpu_section(results)
    if gpu:
        lines += ["", *gpu]
    return "\n".join(lines).rstrip("\n")


def render_glance(results: Path = RESULTS, mode: str = "auto") -> str:
    """README's "At a glance" section, made from the result lines alone."""
    everything = load_all(results)
    return glance_section(chosen(everything, main_mode(everything, mode)), results)


def readme_section(readme: Path, markers: tuple[str, str] = (START, END)) -> str:
    """What is between README's ``markers`` (default: the results section's); raise if
    they are missing."""
    content = readme.read_text()
    start, end = content.find(markers[0]), content.find(markers[1])
    if start < 0 or end < start:
        raise ValueError(f"{readme} has no {markers[0]} ... {markers[1]} markers")
    return content[start + len(markers[0]) : end].strip("\n")


def write_readme(readme: Path, text: str, markers: tuple[str, str] = (START, END)) -> None:
    """Replace what is between ``markers``; raise if they are missing."""
    readme_section(readme, markers)
    content = readme.read_text()
    start, end = content.find(markers[0]), content.find(markers[1])
    readme.write_text(content[: start + len(markers[0])] + "\n" + text + "\n" + content[end:])


def draw(results: Path, docs: Path, mode: str = "auto") -> list[Path]:
    """Draw every plot whose results exist; the paths written."""
    everything = load_all(results)
    picked = chosen(everything, main_mode(everything, mode))
    docs.mkdir(parents=True, exist_ok=True)
    drawn = []
    for name, needs, plot in PLOTS:
        if all(n in picked for n in needs):
            path = plot(picked, docs / name)
            if path is not None:
                drawn.append(path)
    return drawn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("auto", *MODES), default="auto")
    parser.add_argument("--readme", type=Path, default=README_PATH)
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    for path in draw(args.results, args.docs, args.mode):
        print(f"wrote {path}")
    write_readme(args.readme, render(args.results, args.mode))
    write_readme(args.readme, render_glance(args.results, args.mode), GLANCE)
    print(f"wrote the results and glance sections into {args.readme}")


if __name__ == "__main__":
    main()
