"""Step time of each policy and of ``torch.utils.checkpoint`` relative to plain training,
per recipe model, measured side by side.

Prints one JSON line. Every configuration trains its own copy of the same model on the
same batch; a step is ``zero_grad`` + forward + backward (the optimizer step, the same
for all, is left out so that it does not dilute the ratios). The calibrating policies
first run their calibration steps (timed separately: ``calibration_step_ms``; the first
ones also build codecs, and on a GPU compile new Triton kernels, so two calibration
steps after the rounds are timed too: ``calibration_step_warm_ms``). After
one warm-up step each, every round runs every configuration once, in turn (each round
starting one further along), so drift (other work on the machine, clock changes)
affects all alike; ``vs_plain`` is the median over rounds of the step time divided by
the plain step time of the same round. ``amortized_vs_plain`` adds one calibration
step per ``calibrate_every`` (100) steps.

    python -m benchmarks.speed [--quick] [--rounds 5] [--models resnet18 bert_base]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from benchmarks._cases import SPEED_CASES, cases_parser, pick_cases
from benchmarks._harness import (
    CONFIGS,
    POLICIES,
    Runner,
    build_case,
    emit,
    machine,
    make_runner,
    progress,
    resolve_device,
    setup_threads,
    timed_step,
)
from benchmarks._rounds import amortized, interleaved

CALIBRATE_EVERY = 100  # the policies' default


def _timed(runner: Runner, step: int) -> float:
    """Seconds of one step (CUDA events on a GPU). The gradients are dropped after it,
    so that the configurations' model copies do not all hold a set (BERT-base: 440 MB)."""
    device = next(runner.module.parameters()).device
    seconds = timed_step(lambda: runner.step(step), device)
    runner.module.zero_grad(set_to_none=True)
    return seconds


def _calibration_times(runner: Runner) -> list[float]:
    if not runner.calibrates:
        return []
    return [_timed(runner, step) for step in runner.calibration_steps()]


def measure_model(args: argparse.Namespace, name: str) -> dict[str, Any]:
    device = resolve_device(args.device)
    recipe = build_case(name, args.quick, device, batch_size=args.batch_size)
    runners = {config: make_runner(config, recipe) for config in args.configs}
    calibration = {
        config: _calibration_times(r)
        for config, r in progress(runners.items(), f"speed {name}: calibration", len(runners))
    }
    for runner in runners.values():  # warm-up
        _timed(runner, runner.measured_step)
    times = interleaved(
        args.rounds, list(runners), lambda c: _timed(runners[c], runners[c].measured_step),
        f"speed {name}: rounds",
    )  # fmt: skip
    # Calibration steps again after the rounds: the first three also build codecs (and on
    # a GPU compile each new width's Triton kernels), a one-time cost of a fit.
    warm = {
        config: [_timed(r, k * r.policy.calibrate_every) for k in (1, 2)]
        for config, r in runners.items()
        if r.calibrates
    }
    for runner in runners.values():
        runner.close()
    plain = times["plain"]
    configs: dict[str, dict[str, Any]] = {}
    for config, ts in times.items():
        ratio = statistics.median(t / p for t, p in zip(ts, plain, strict=True))
        row: dict[str, Any] = {
            "step_ms": round(1e3 * statistics.median(ts), 2),
            "min_ms": round(1e3 * min(ts), 2),
            "vs_plain": round(ratio, 3),
        }
        # The first calibration step also builds the policy's codecs; the median of the
        # three is the typical cost.
        if calibration[config]:
            calib = statistics.median(calibration[config])
            row["calibration_step_ms"] = round(1e3 * calib, 2)
            row["calibration_step_warm_ms"] = round(1e3 * statistics.median(warm[config]), 2)
            step = statistics.median(ts)
            row["amortized_vs_plain"] = amortized(ratio, step, calib, CALIBRATE_EVERY)
        configs[config] = row
    return {
        "family": recipe.name,
        "description": recipe.description,
        "plain_step_ms": configs["plain"]["step_ms"],
        "configs": configs,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cases_parser(__doc__, "_cases.SPEED_CASES")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=CONFIGS,
        help="plain is always included",
    )
    parser.add_argument("--rounds", type=int, default=None, help="default: 7 quick, 5 full")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the case's")
    args = parser.parse_args(argv)
    setup_threads(args)
    mode = "quick" if args.quick else "full"
    if args.rounds is None:
        args.rounds = 7 if args.quick else 5
    if "plain" not in args.configs:
        args.configs = ["plain", *args.configs]
    args.models = pick_cases(parser, args.models, mode, SPEED_CASES)
    device = resolve_device(args.device)
    print(
        f"speed ({mode}): {args.models}, batch {args.batch_size or 'of each case'}, "
        f"{args.rounds} rounds, {args.threads} thread(s), {device}; {args.configs}",
        file=sys.stderr,
    )
    models = {name: measure_model(args, name) for name in args.models}
    result = {
        "benchmark": "speed",
        "mode": mode,
        "machine": machine(device),
        "threads": args.threads,
        "rounds": args.rounds,
        "step": "zero_grad + forward + backward, median over interleaved rounds",
        "calibrate_every": CALIBRATE_EVERY,
        "policies": {k: {"policy": p, **o} for k, (p, o) in POLICIES.items()},
        "models": models,
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
