"""Where a compressed training step spends its time on a GPU: the host syncs (by the
Python line that causes them), the ops with the most host time, and the hooks' Python,
per configuration.

    python scripts/gpu_profile.py [--cases resnet50_imagenet] [--configs plain quant2 acgc]

For each case and configuration: the step's median time over a few steps, then one step
under ``torch.cuda.set_sync_debug_mode("warn")`` (every synchronizing call is counted by
its Python file and line), one under ``torch.profiler`` (the top ops by self host time
and the summed kernel time) and one under ``cProfile`` (the Python functions by own
time). Prints one JSON line per configuration; ``--device cpu --quick`` is a dry run.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import json
import pstats
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import build_case, make_runner, timed_step

WARMUP = 4
TIMED = 5


def _sync_sites(runner, step: int) -> dict[str, int]:
    """The synchronizing calls of one step, counted by the Python line that made them."""
    sites: collections.Counter[str] = collections.Counter()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.step(step)
            if cuda:
                torch.cuda.synchronize()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return dict(sites.most_common(15))


def _profile(runner, step: int, top: int) -> dict[str, object]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        runner.step(step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    return {
        "device_kernel_ms": round(device_us / 1e3, 2),
        "host_top": [[e.key[:60], e.count, round(e.self_cpu_time_total / 1e3, 2)] for e in rows],
    }


def _python_top(runner, step: int, top: int) -> list[str]:
    """The Python functions of one step with the most own time (cProfile lines)."""
    profile = cProfile.Profile()
    profile.enable()
    runner.step(step)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), len(lines))
    return [" ".join(line.split()) for line in lines[start : start + top + 1] if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="+", default=["resnet50_imagenet"])
    parser.add_argument("--configs", nargs="+", default=["plain", "quant2", "acgc"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="the quick cases (a dry run)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    for case in args.cases:
        recipe = build_case(case, args.quick, device, batch_size=args.batch_size)
        for config in args.configs:
            runner = make_runner(config, recipe)
            for step in range(WARMUP):
                runner.step(step)
            step = WARMUP + 1  # not a calibration step
            one_step = functools.partial(runner.step, step)
            times = [timed_step(one_step, device) for _ in range(TIMED)]
            row = {"case": case, "config": config}
            row["step_ms"] = round(1e3 * statistics.median(times), 2)
            try:
                row["syncs"] = _sync_sites(runner, step)
                row.update(_profile(runner, step, args.top))
                row["python_top"] = _python_top(runner, step, args.top)
            except Exception as error:  # keep the other configurations' rows
                row["error"] = repr(error)
            runner.close()
            print(json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
