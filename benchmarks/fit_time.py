"""acgc's fit time against plain training, side by side: the figure the project's
fit-time bar reads.

A fit step as a Lightning fit runs it: ``zero_grad``, forward, backward and the recipe's
optimizer step (``build_optimizer``: AdamW for BERT and the GCN, SGD with Nesterov
momentum for the ResNets), each configuration on its own copy of the model with its own
optimizer. Only plain and acgc at its default are in the process, and they alternate
step by step (each round starting with the other one), so that the pair shares the
machine's state; ``speed`` interleaves every configuration and leaves the optimizer out.

acgc calibrates as a fit does: on its first three steps (a one-time cost that also
builds the codecs: ``first_calibrations_extra_s`` against plain's first three steps),
then on one step in each ``calibrate_every``, timed after the rounds at steps
``calibrate_every`` and twice that (``calibration_step_s``). Per configuration:
``step_vs_plain`` is the median over rounds of the paired ratio of whole steps,
``grad_vs_plain`` the same of forward + backward alone (from the same steps);
``fit_vs_plain`` adds one calibration per ``calibrate_every`` steps,
``fit_1000_vs_plain`` also the first three, over a fit of 1,000 steps.

    python -m benchmarks.fit_time [--quick] [--rounds 21] [--models bert_base]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from benchmarks._cases import SPEED_CASES, cases_parser, pick_cases
from benchmarks._harness import (
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

CONFIGS = ("plain", "acgc")
FIT_STEPS = 1000  # the finite fit that fit_1000_vs_plain prices the first calibrations over


def fit_step(
    runner: Runner, optimizer: torch.optim.Optimizer, step: int, device: torch.device
) -> tuple[float, float]:
    """Seconds of one fit step's forward + backward (``zero_grad`` included) and of its
    optimizer step."""
    grad = timed_step(lambda: runner.step(step), device)
    return grad, timed_step(optimizer.step, device)


def measure_model(args: argparse.Namespace, name: str) -> dict[str, Any]:
    device = resolve_device(args.device)
    recipe = build_case(name, args.quick, device)
    runners = {config: make_runner(config, recipe) for config in CONFIGS}
    optimizers = {c: r.module.build_optimizer() for c, r in runners.items()}  # type: ignore[operator]
    first = {
        c: [sum(fit_step(r, optimizers[c], s, device)) for s in r.calibration_steps()]
        for c, r in progress(runners.items(), f"fit_time {name}: first steps", len(runners))
    }
    for c, r in runners.items():  # warm-up
        fit_step(r, optimizers[c], r.measured_step, device)
    times = interleaved(
        args.rounds, CONFIGS,
        lambda c: fit_step(runners[c], optimizers[c], runners[c].measured_step, device),
        f"fit_time {name}: rounds",
    )  # fmt: skip
    acgc = runners["acgc"]
    every = acgc.policy.calibrate_every  # type: ignore[union-attr]
    calibrations = [sum(fit_step(acgc, optimizers["acgc"], k * every, device)) for k in (1, 2)]
    for runner in runners.values():
        runner.close()

    def paired(part: Any) -> float:
        pairs = zip(times["acgc"], times["plain"], strict=True)
        return statistics.median(part(a) / part(p) for a, p in pairs)

    plain, row = _medians(times["plain"]), _medians(times["acgc"])
    calibration_s = statistics.median(calibrations)
    step_ratio = paired(lambda t: t[0] + t[1])
    fit = amortized(step_ratio, row["step_s"], calibration_s, every)
    # (acgc's first steps include any it calibrated again: against as many plain steps)
    extra = sum(first["acgc"]) - len(first["acgc"]) * statistics.fmean(first["plain"])
    row |= {
        "step_vs_plain": round(step_ratio, 3),
        "grad_vs_plain": round(paired(lambda t: t[0]), 3),
        "calibration_step_s": round(calibration_s, 3),
        "calibrate_every": every,
        "fit_vs_plain": fit,
        "first_calibrations_extra_s": round(extra, 2),
        "fit_1000_vs_plain": round(fit + extra / (FIT_STEPS * plain["step_s"]), 3),
    }
    return {
        "family": recipe.name,
        "description": recipe.description,
        "optimizer": type(optimizers["plain"]).__name__,
        "plain": plain,
        "acgc": row,
    }


def _medians(times: list[tuple[float, float]]) -> dict[str, float]:
    """Median seconds of the whole step, of forward + backward and of the optimizer step,
    from (forward + backward, optimizer) pairs."""
    return {
        "step_s": round(statistics.median(g + o for g, o in times), 4),
        "grad_s": round(statistics.median(g for g, _ in times), 4),
        "optimizer_s": round(statistics.median(o for _, o in times), 4),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cases_parser(__doc__, "_cases.SPEED_CASES")
    parser.add_argument("--rounds", type=int, default=None, help="default: 5 quick, 21 full")
    args = parser.parse_args(argv)
    setup_threads(args)
    mode = "quick" if args.quick else "full"
    if args.rounds is None:
        args.rounds = 5 if args.quick else 21
    args.models = pick_cases(parser, args.models, mode, SPEED_CASES)
    device = resolve_device(args.device)
    print(
        f"fit_time ({mode}): {args.models}, {args.rounds} rounds, {args.threads} thread(s), "
        f"{device}",
        file=sys.stderr,
    )
    result = {
        "benchmark": "fit_time",
        "mode": mode,
        "machine": machine(device),
        "threads": args.threads,
        "rounds": args.rounds,
        "step": "zero_grad + forward + backward + optimizer step, plain and acgc alternating",
        "models": {name: measure_model(args, name) for name in args.models},
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
