"""Activation memory of one training step per model: plain training,
``torch.utils.checkpoint`` per block, and each policy, measured side by side.

Prints one JSON line. For each case (``benchmarks/_cases.py``: the size presets in full
mode, small models with ``--quick``) and configuration:

- ``saved_bytes`` / ``kept_bytes`` / ``ratio``: activations autograd saves in one plain
  training step (the engine's meter, nothing compressed) and what each configuration
  keeps instead. Policies first run their calibration steps (``CALIBRATION_STEPS``,
  with the exact gradient where the policy verifies, and any acgc calibrates again after
  a broken one: ``Runner.calibration_steps``); the ordinary step after them is measured.
  ``meter_saved_bytes`` / ``meter_ratio``: the meter's own count under
  compression (what ``acgc/ratio`` logs). ``checkpoint`` (non-reentrant, per residual
  block, encoder layer or message-passing layer): the meter, plus the block inputs that
  checkpointing keeps.
- ``grad_error``: ‖ĝ − g‖/‖g‖ of the measured step against the exact gradient of the
  same batch (dropout seeded alike); ``calibration_grad_error``: the policy's own
  reading on its last calibration step.
- ``step_peak_mb``: whole-process memory during one step above the memory before it, in
  a child process per configuration forked from a server that has imported everything
  once. CPU: the RSS high-water mark (``/proc/self/clear_refs`` resets it after a
  warm-up step, whose parameter gradients are freed first, so the peak holds this
  step's activations, gradients and transient buffers; where it cannot, ``ru_maxrss``
  of the first step); GPU:
  ``torch.cuda.max_memory_allocated``. ``predicted_step_peak_mb``: plain's peak less the
  activation bytes the configuration no longer keeps; ``peak_vs_predicted``: their
  ratio. ``timeline``: [ms, MB above the start] through the step, sampled every ms.
- ``sites`` (``acgc``): per site, bytes before and after, codec and setting.

    python -m benchmarks.memory [--quick] [--models resnet50_imagenet ...] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import pickle
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from benchmarks._cases import cases_parser, pick_cases
from benchmarks._harness import (
    CALIBRATION_STEPS,
    CONFIGS,
    DEFAULT_CASES,
    POLICIES,
    Recipe,
    Runner,
    build_case,
    count_saved,
    emit,
    machine,
    make_runner,
    progress,
    resolve_device,
    setup_threads,
    synchronize,
)
from benchmarks._peak import (
    Timeline,
    limit_malloc,
    maxrss_bytes,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)

MB = 2**20


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration's step in a fresh process: the peak memory during it."""
    setup_threads(args)
    device = resolve_device(args.device)
    recipe = build_case(args.model, args.quick, device, batch_size=args.batch_size)
    runner = make_runner(args.config, recipe)
    if args.state:
        with open(args.state, "rb") as f:
            runner.policy.load_state_dict(pickle.load(f))  # the parent's calibration
    can_reset = reset_peak_rss()
    if can_reset:
        runner.step()  # warm-up: one-time allocations (thread pools, kernels' caches)
        # its parameter gradients would be freed at the measured step's start, and the
        # step's activations would take their place unseen (BERT-base: 440 MB each)
        runner.module.zero_grad(set_to_none=True)
    gc.collect()
    synchronize(device)
    cuda_before = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        cuda_before = torch.cuda.memory_allocated(device)
    if can_reset:
        reset_peak_rss()
    before = rss_bytes()
    with Timeline(device) as timeline:
        runner.step()
        synchronize(device)
    peak = peak_rss_bytes() if can_reset else maxrss_bytes()
    base = cuda_before if device.type == "cuda" else before
    out = {
        "rss_before_mb": round(before / MB, 2),
        "rss_peak_mb": round(peak / MB, 2),
        "rss_step_peak_mb": round((peak - before) / MB, 2),
        "peak_method": "VmHWM after clear_refs" if can_reset else "ru_maxrss, first step",
        "timeline": timeline.points(base),
    }
    if device.type == "cuda":
        out["cuda_step_peak_mb"] = round(
            (torch.cuda.max_memory_allocated(device) - cuda_before) / MB, 2
        )
    return out


def _child_main(conn: Connection, options: dict[str, Any]) -> None:
    limit_malloc()
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


def _in_process(options: dict[str, Any]) -> dict[str, Any]:
    """:func:`child` in this process, for a GPU: CUDA's peak counter is exact per
    process, and a child forked from the server cannot initialize CUDA (the parent's
    RSS figures then mean nothing and are left out)."""
    try:
        result = child(argparse.Namespace(**options))
    except Exception as err:  # reported in the JSON, the other configurations go on
        result = {"error": f"{type(err).__name__}: {err}"}
    for key in ("rss_before_mb", "rss_peak_mb", "rss_step_peak_mb", "peak_method"):
        result.pop(key, None)
    gc.collect()
    torch.cuda.empty_cache()
    return result


def run_child(
    args: argparse.Namespace, model: str, config: str, state: Path | None
) -> dict[str, Any]:
    """:func:`child` in a process of its own (on a GPU: in this one)."""
    options = {
        "device": args.device,
        "threads": args.threads,
        "quick": args.quick,
        "batch_size": args.batch_size,
        "model": model,
        "config": config,
        "state": None if state is None else str(state),
    }
    if resolve_device(args.device).type == "cuda":
        return _in_process(options)
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


GRAD_SEED = 1234  # the same dropout masks in the exact and the measured step


def _gradients(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]


def gradient_error(exact: list[torch.Tensor], runner: Runner) -> float:
    """‖ĝ − g‖/‖g‖ of the step just run against the exact gradient of the same batch."""
    got = _gradients(runner.module)
    num = sum(float((a - b).double().square().sum()) for a, b in zip(got, exact, strict=True))
    den = sum(float(b.double().square().sum()) for b in exact)
    return (num / den) ** 0.5 if den > 0 else float("nan")


def _measure_config(
    config: str, recipe: Recipe, plain_bytes: int, exact: list[torch.Tensor], tmp: Path
) -> tuple[dict[str, Any], Path | None, Any]:
    """One configuration in this process: bytes kept, gradient error, its policy's state."""
    runner = make_runner(config, recipe)
    state, stats = None, None
    if config == "plain":
        row: dict[str, Any] = {"saved_bytes": plain_bytes, "kept_bytes": plain_bytes}
    elif config == "checkpoint":
        kept = count_saved(recipe, runner.module, runner.blocks)
        row = {"saved_bytes": plain_bytes, "kept_bytes": kept, "blocks": len(runner.blocks)}
    else:
        calibration = runner.calibrate()
        measured = [m["grad_error"] for m in calibration if "grad_error" in m]
        torch.manual_seed(GRAD_SEED)
        stats = runner.step()
        # ratio against what plain training saves; the meter's own count of saved bytes
        # (the denominator of acgc/ratio) is kept beside it
        row = {
            "saved_bytes": plain_bytes,
            "kept_bytes": stats.packed_bytes,
            "meter_saved_bytes": stats.saved_bytes,
            "meter_ratio": round(stats.ratio, 3),
        }
        if measured:
            row["calibration_grad_error"] = round(measured[-1], 5)  # the policy's own reading
        state = tmp / f"{recipe.name}-{config}.pkl"
        with open(state, "wb") as f:
            pickle.dump(runner.policy.state_dict(), f)
    if config != "plain" and stats is None:
        torch.manual_seed(GRAD_SEED)
        runner.step()
    row["grad_error"] = 0.0 if config == "plain" else round(gradient_error(exact, runner), 5)
    runner.close()
    return row, state, stats


def measure_model(args: argparse.Namespace, name: str, tmp: Path) -> dict[str, Any]:
    device = resolve_device(args.device)
    recipe = build_case(name, args.quick, device, batch_size=args.batch_size)
    plain_bytes = count_saved(recipe, recipe.module)
    exact_runner = make_runner("plain", recipe)
    torch.manual_seed(GRAD_SEED)
    exact_runner.step()
    exact = _gradients(exact_runner.module)
    del exact_runner
    configs: dict[str, dict[str, Any]] = {}
    sites: dict[str, list] = {}
    for config in progress(args.configs, f"memory {name}"):
        row, state, stats = _measure_config(config, recipe, plain_bytes, exact, tmp)
        if config == "acgc" and stats is not None:
            sites[config] = _sites(stats)
        row["ratio"] = round(row["saved_bytes"] / row["kept_bytes"], 3)
        row["saved_mb"] = round(row["saved_bytes"] / MB, 3)
        row["kept_mb"] = round(row["kept_bytes"] / MB, 3)
        if not args.no_peak:
            row.update(run_child(args, name, config, state))
        configs[config] = row
    _predict_peaks(configs, device)
    grad_bytes = sum(
        p.numel() * p.element_size() for p in recipe.module.parameters() if p.requires_grad
    )
    return {
        "family": recipe.name,
        "description": recipe.description,
        "grad_mb": round(grad_bytes / MB, 1),  # a floor of every configuration's step peak
        "configs": configs,
        "sites": sites,
    }


def _predict_peaks(configs: dict[str, dict[str, Any]], device: torch.device) -> None:
    """Each configuration's step peak beside what its activation ratio predicts: plain's
    peak less the activation bytes it no longer keeps."""
    key = "cuda_step_peak_mb" if device.type == "cuda" else "rss_step_peak_mb"
    plain_peak = configs.get("plain", {}).get(key)
    for row in configs.values():
        peak = row.get(key)
        if not plain_peak or peak is None:
            continue
        predicted = plain_peak - (row["saved_bytes"] - row["kept_bytes"]) / MB
        row["step_peak_mb"] = peak
        row["step_peak_vs_plain"] = round(peak / plain_peak, 3)
        row["predicted_step_peak_mb"] = round(predicted, 2)
        row["peak_vs_predicted"] = round(peak / predicted, 3) if predicted > 0 else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cases_parser(__doc__, "one a family")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the case's")
    parser.add_argument("--no-peak", action="store_true", help="skip the child processes")
    args = parser.parse_args(argv)
    setup_threads(args)
    mode = "quick" if args.quick else "full"
    args.models = pick_cases(parser, args.models, mode, DEFAULT_CASES)
    if "plain" not in args.configs:
        args.configs = ["plain", *args.configs]
    device = resolve_device(args.device)
    print(
        f"memory ({mode}): {args.models}, batch {args.batch_size or 'of each case'}, "
        f"{args.threads} thread(s), {device}; configurations {args.configs}",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory() as tmp:
        models = {name: measure_model(args, name, Path(tmp)) for name in args.models}
    result = {
        "benchmark": "memory",
        "mode": mode,
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
