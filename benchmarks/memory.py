"""Activation memory of one training step per recipe model: plain training,
``torch.utils.checkpoint`` per block, and each policy, measured side by side.

Prints one JSON line. For each recipe model (ResNet, BERT, GNN at their offline
defaults; small sizes with ``--quick``) and configuration:

- ``saved_bytes`` / ``kept_bytes`` / ``ratio``: activations autograd saves in one plain
  training step (the engine's meter, nothing compressed) and what each configuration
  keeps instead. Policies first run their calibration steps (``CALIBRATION_STEPS``,
  with the exact gradient where the policy verifies); the ordinary step after them is
  measured. ``meter_saved_bytes`` / ``meter_ratio``: the meter's own count under
  compression (what ``acgc/ratio`` logs); it exceeds ``saved_bytes`` where one tensor
  is packed more than once. ``checkpoint`` (non-reentrant, per residual block, encoder
  layer or conv layer): the meter, plus the block inputs that checkpointing keeps.
- ``rss_step_peak_mb``: whole-process memory during one step above the memory before it.
  CPU: peak RSS of a child process per configuration, forked from a server that has
  imported everything once (``/proc/self/clear_refs`` resets the high-water mark after a
  warm-up step; where it cannot, ``ru_maxrss`` of the first step); GPU:
  ``torch.cuda.max_memory_allocated`` (also in a child per configuration).
- ``sites`` (``acgc``): per site, bytes before and after, codec and setting.

    python -m benchmarks.memory [--quick] [--models resnet bert gnn] [--device auto]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing
import pickle
import resource
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from benchmarks._harness import (
    CALIBRATION_STEPS,
    CONFIGS,
    MEASURED_STEP,
    MODELS,
    POLICIES,
    add_common_arguments,
    build_recipe,
    count_saved,
    emit,
    machine,
    make_runner,
    resolve_device,
    setup_threads,
    synchronize,
)

MB = 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


# ----------------------------------------------------------------------------- RSS
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    if kb is not None:
        return 1024 * kb
    return _maxrss_bytes()  # no /proc: the best there is


def _maxrss_bytes() -> int:
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else 1024 * value


def _reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark (Linux >= 4.0); False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm = _status_kb("VmHWM")
    return hwm is not None and 1024 * hwm <= _rss_bytes() + 1024


def _peak_rss_bytes() -> int:
    hwm = _status_kb("VmHWM")
    return 1024 * hwm if hwm is not None else _maxrss_bytes()


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration's step in a fresh process: the peak memory during it."""
    setup_threads(args)
    device = resolve_device(args.device)
    recipe = build_recipe(args.model, args.quick, device)
    runner = make_runner(args.config, recipe)
    if args.state:
        with open(args.state, "rb") as f:
            runner.policy.load_state_dict(pickle.load(f))  # the parent's calibration
    can_reset = _reset_peak_rss()
    if can_reset:
        runner.step()  # warm-up: one-time allocations (thread pools, kernels' caches)
    gc.collect()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        cuda_before = torch.cuda.memory_allocated(device)
    if can_reset:
        _reset_peak_rss()
    before = _rss_bytes()
    runner.step()
    synchronize(device)
    peak = _peak_rss_bytes() if can_reset else _maxrss_bytes()
    out = {
        "rss_before_mb": round(before / MB, 2),
        "rss_peak_mb": round(peak / MB, 2),
        "rss_step_peak_mb": round((peak - before) / MB, 2),
        "peak_method": "VmHWM after clear_refs" if can_reset else "ru_maxrss, first step",
    }
    if device.type == "cuda":
        out["cuda_step_peak_mb"] = round(
            (torch.cuda.max_memory_allocated(device) - cuda_before) / MB, 2
        )
    return out


def _limit_malloc() -> None:
    """glibc: return freed blocks above 128 KiB to the system at once (no dynamic mmap
    threshold), so that the RSS before a step is not inflated by the warm-up step's
    freed memory. Elsewhere nothing is changed."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)


def _child_main(conn: Connection, options: dict[str, Any]) -> None:
    _limit_malloc()
    try:
        result = child(argparse.Namespace(**options))
    except Exception as err:  # reported in the JSON, the other configurations go on
        result = {"error": f"{type(err).__name__}: {err}"}
    conn.send(result)
    conn.close()


def _context() -> multiprocessing.context.BaseContext:
    """Children forked from a server that has imported torch, Lightning and the recipes
    once (``spawn`` where there is no ``forkserver``)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["benchmarks._harness", "recipes.models", "recipes.config_schema"])
    return ctx


def run_child(
    args: argparse.Namespace, model: str, config: str, state: Path | None
) -> dict[str, Any]:
    """:func:`child` in a process of its own."""
    options = {
        "device": args.device,
        "threads": args.threads,
        "quick": args.quick,
        "model": model,
        "config": config,
        "state": None if state is None else str(state),
    }
    ctx = _context()
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child_main, args=(send, options))
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        result = {"error": f"child process died (exit code {process.join() or process.exitcode})"}
    process.join()
    return result


# ----------------------------------------------------------------------------- parent
def _sites(stats: Any) -> list[dict[str, Any]]:
    return [
        {
            "key": rec.key,
            "module_type": rec.module_type,
            "shape": list(rec.shape),
            "codec": rec.codec,
            "settings": rec.settings,
            "raw_bytes": rec.raw_bytes,
            "packed_bytes": rec.packed_bytes,
        }
        for rec in stats.sites.values()
    ]


def measure_model(args: argparse.Namespace, name: str, tmp: Path) -> dict[str, Any]:
    device = resolve_device(args.device)
    recipe = build_recipe(name, args.quick, device)
    plain_bytes = count_saved(recipe, recipe.module)
    configs: dict[str, dict[str, Any]] = {}
    sites: dict[str, list] = {}
    for config in args.configs:
        state = None
        if config == "plain":
            row: dict[str, Any] = {"saved_bytes": plain_bytes, "kept_bytes": plain_bytes}
        elif config == "checkpoint":
            runner = make_runner(config, recipe)
            kept = count_saved(recipe, runner.module, runner.blocks)
            row = {"saved_bytes": plain_bytes, "kept_bytes": kept, "blocks": len(runner.blocks)}
        else:
            runner = make_runner(config, recipe)
            calibration = runner.calibrate()
            stats = runner.step(MEASURED_STEP)
            # ratio against what plain training saves; the meter's own count of saved
            # bytes (the denominator of acgc/ratio) is kept beside it
            row = {
                "saved_bytes": plain_bytes,
                "kept_bytes": stats.packed_bytes,
                "meter_saved_bytes": stats.saved_bytes,
                "meter_ratio": round(stats.ratio, 3),
            }
            measured = [m["grad_error"] for m in calibration if "grad_error" in m]
            if measured:
                row["grad_error"] = round(measured[-1], 5)  # last calibration step
            if config == "acgc":
                sites[config] = _sites(stats)
            state = tmp / f"{name}-{config}.pkl"
            with open(state, "wb") as f:
                pickle.dump(runner.policy.state_dict(), f)
            runner.close()
        row["ratio"] = round(row["saved_bytes"] / row["kept_bytes"], 3)
        row["saved_mb"] = round(row["saved_bytes"] / MB, 3)
        row["kept_mb"] = round(row["kept_bytes"] / MB, 3)
        if not args.no_peak:
            row.update(run_child(args, name, config, state))
        configs[config] = row
    plain_peak = configs.get("plain", {}).get("rss_step_peak_mb")
    for row in configs.values():
        peak = row.get("rss_step_peak_mb")
        if plain_peak and peak is not None:
            row["step_peak_vs_plain"] = round(peak / plain_peak, 3)
    return {"description": recipe.description, "configs": configs, "sites": sites}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--no-peak", action="store_true", help="skip the child processes")
    args = parser.parse_args(argv)
    setup_threads(args)
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        models = {name: measure_model(args, name, Path(tmp)) for name in args.models}
    result = {
        "benchmark": "memory",
        "mode": "quick" if args.quick else "full",
        "machine": machine(device),
        "calibration_steps": CALIBRATION_STEPS,
        "policies": {k: {"policy": p, **o} for k, (p, o) in POLICIES.items()},
        "peak": "RSS of a child process" if device.type == "cpu" else "cuda max allocated",
        "models": models,
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
