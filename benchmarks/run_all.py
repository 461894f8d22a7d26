"""Run every benchmark and keep its JSON line in ``benchmarks/results/<name>.jsonl``.

Each benchmark runs in a process of its own (``python -m benchmarks.<name>``), one after
the other. A results file holds at most one line per mode (``quick``, ``full``) and
device kind (CPU, GPU): a new run replaces the line of its own mode and device kind and
keeps the others; README's main tables come from the CPU lines, a GPU section from the
GPU lines. Every line carries the
machine it was measured on (platform, CPU, core count, torch, threads, device, date),
the command and its wall time. Then ``python -m benchmarks.report`` draws the plots and
fills the table in README.md.

    python -m benchmarks.run_all --quick      # a few minutes on 2 CPU cores
    python -m benchmarks.run_all --full       # the size presets (the default); CUDA when available
    python -m benchmarks.run_all --full --only memory speed --device cuda --batch-size 64
    python -m benchmarks.run_all --full --only kernels codecs --device cuda
    python -m benchmarks.run_all --full --only speed --rounds 9   # more rounds: less noise

Full mode on 2 CPU cores (AMD EPYC, last timed 2026-11-25), each case at its default
batch (``benchmarks/_cases.py``): memory 9 min, speed (5 interleaved rounds) 9 min,
acgc_vs_fixed 7 min, tradeoff 4 min, batch 1 min, codecs under 1 min, accuracy (3
configurations x 3 recipes x 3 seeds, 10 epochs) about 15 min: about 45 minutes. On
the 2-core Intel Xeon (2026-11-28): promise about 5 min, margin (3 targets, each with
promise's fits) about 17 min, and acgc_vs_fixed with its size presets about 19 min. On the
AMD EPYC (2026-11-29): speed with 9 rounds about 44 min, fit_time (21 rounds) about
15 min, margin with its 4 targets about 19 min (beside promise, 5 min); on 2026-11-30
causal_lm (GPT-2 small and SmolLM-135M dimensions, 3 rounds) 14 min.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS = (
    "memory",
    "speed",
    "fit_time",
    "causal_lm",
    "accuracy",
    "batch",
    "tradeoff",
    "codecs",
    "cpu_backends",
    "acgc_vs_fixed",
    "bn_error_model",
    "promise",
    "margin",
    "precision",
)
# The benchmarks that repeat interleaved rounds (``--rounds``; each has its own default).
ROUNDS = ("speed", "fit_time", "causal_lm", "codecs", "cpu_backends")
# Run only when asked (``--only kernels``): the Triton kernels' GB/s mean something on a GPU.
EXTRA = ("kernels",)


def last_json_line(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object with a ``benchmark`` key."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict) and "benchmark" in value:
                return value
    raise ValueError("the benchmark printed no JSON line")


def read_results(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def device_kind(result: dict[str, Any]) -> str:
    """``cuda`` for a line measured on a GPU, else ``cpu``."""
    device = str(result.get("machine", {}).get("device", "cpu"))
    return "cuda" if device.startswith("cuda") else "cpu"


def store(result: dict[str, Any], results: Path = RESULTS) -> Path:
    """Write ``result`` to its benchmark's file, replacing the line of the same mode and
    device kind (CPU and GPU lines of one mode are kept side by side). A ``fit_time`` run
    of some models keeps the replaced line's other models (:func:`with_earlier_models`)."""
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{result['benchmark']}.jsonl"
    key = (result.get("mode"), device_kind(result))
    kept, replaced = [], None
    for r in read_results(path):
        if (r.get("mode"), device_kind(r)) == key:
            replaced = r
        else:
            kept.append(r)
    if result["benchmark"] == "fit_time":
        result = with_earlier_models(replaced, result)
    lines = [json.dumps(r) for r in [*kept, result]]
    path.write_text("\n".join(lines) + "\n")
    return path


def with_earlier_models(earlier: dict[str, Any] | None, newer: dict[str, Any]) -> dict[str, Any]:
    """``newer``'s line, with the models only ``earlier`` measured carried over before its
    own, each model naming the commit it was measured at (a run of some models leaves the
    others' rows standing; each row's two configurations still come from one run).

    Example:
        >>> old = {"commit": "a1", "models": {"bert": {}, "gcn": {}}}
        >>> new = with_earlier_models(old, {"commit": "b2", "models": {"gcn": {}, "llama": {}}})
        >>> {m: info["commit"] for m, info in new["models"].items()}
        {'bert': 'a1', 'gcn': 'b2', 'llama': 'b2'}
    """
    carried = {
        m: {**info, "commit": info.get("commit", earlier.get("commit"))}
        for m, info in (earlier or {}).get("models", {}).items()
        if m not in newer["models"]
    }
    own = {m: {**info, "commit": newer.get("commit")} for m, info in newer["models"].items()}
    return {**newer, "models": {**carried, **own}}


def run(name: str, options: list[str]) -> tuple[dict[str, Any] | None, float, str]:
    """Run one benchmark: its result (``None`` on failure), seconds, and the output tail."""
    command = [sys.executable, "-m", f"benchmarks.{name}", *options]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    # stderr (progress bars, settings, errors) goes to the terminal as it comes
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    tail = "\n".join(done.stdout.strip().splitlines()[-15:])
    if done.returncode != 0:
        return None, seconds, tail
    try:
        result = last_json_line(done.stdout)
    except ValueError:
        return None, seconds, tail
    result["command"] = f"python -m benchmarks.{name} {' '.join(options)}".strip()
    result["seconds"] = round(seconds, 1)
    return result, seconds, tail


def extra_options(name: str, batch_size: int | None, rounds: int | None) -> list[str]:
    """The options of benchmark ``name`` beyond the common ones: ``--batch-size`` for the
    sized ones, ``--rounds`` for those that repeat rounds.

    Example:
        >>> extra_options("speed", 8, 9), extra_options("memory", None, 9)
        (['--batch-size', '8', '--rounds', '9'], [])
    """
    extra = []
    if batch_size is not None and name in ("memory", "speed", "causal_lm", "batch"):
        extra += ["--batch-size", str(batch_size)]
    if rounds is not None and name in ROUNDS:
        extra += ["--rounds", str(rounds)]
    return extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small sizes (2 CPU cores)")
    mode.add_argument("--full", action="store_true", help="the size presets (the default)")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="memory and speed: batch of every case"
    )
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds of " + ", ".join(ROUNDS)
    )
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS + EXTRA, default=list(BENCHMARKS))
    args = parser.parse_args(argv)
    options = ["--device", args.device]
    options += ["--quick"] if args.quick else []
    options += ["--threads", str(args.threads)] if args.threads is not None else []
    failed = []
    total = time.perf_counter()
    for name in args.only:
        extra = extra_options(name, args.batch_size, args.rounds)
        print(f"{name}: running (python -m benchmarks.{name} {' '.join(options + extra)})")
        result, seconds, tail = run(name, options + extra)
        if result is None:
            failed.append(name)
            print(f"{name}: FAILED after {seconds:.0f} s\n{tail}", flush=True)
            continue
        path = store(result)
        print(f"{name}: {seconds:.0f} s -> {path.relative_to(ROOT)}", flush=True)
    print(f"all: {time.perf_counter() - total:.0f} s" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
