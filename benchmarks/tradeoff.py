"""AC-GC's trade-off on the ResNet recipe: compression ratio vs measured gradient error for
several allowed errors e, and the bounds' trajectory over a short training run.

Prints one JSON line with two parts:

- ``tradeoff``: for each e in ``--errors``, a short training run with ``acgc`` verifying
  on every step (``calibrate_every=1``): the exact gradient is computed and the
  measured relative error ‖ĝ − g‖/‖g‖ compared with the promise. Per e: the ratio and
  measured error of the steps after the warm-up (median and max).
- ``trajectory``: one longer run at e = 0.05, calibrating every ``--calibrate-every``
  steps: per calibration step, the mean log10 error bound (``log10_bound``), the
  measured error, κ (measured over modelled error) and the step's ratio.

Training: the recipe's SGD settings at a constant learning rate, one batch after another
from its training loader.

    python -m benchmarks.tradeoff [--quick] [--errors 0.01 0.02 0.05 0.1 0.2]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from typing import Any

import torch
from torch.nn import functional as F

from benchmarks._harness import (
    add_common_arguments,
    build_recipe,
    emit,
    machine,
    resolve_device,
    setup_threads,
)
from lightning_acgc import ActivationCompressor, build_policy, compressed_step

WARMUP = 3  # acgc's warm-up calibrations (its default warmup_steps)


def _to(batch: Any, device: torch.device) -> Any:
    return type(batch)(b.to(device) for b in batch)


def train_acgc(
    args: argparse.Namespace, gradient_error: float, steps: int, calibrate_every: int
) -> tuple[list[dict[str, float]], str]:
    """``steps`` training steps of the ResNet recipe under ``acgc``: one record per step,
    and the model's description."""
    device = resolve_device(args.device)
    recipe = build_recipe("resnet", args.quick, device)
    module, cfg = recipe.module, recipe.cfg.model
    optimizer = torch.optim.SGD(
        module.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )
    policy = build_policy(
        "acgc",
        gradient_error=gradient_error,
        calibrate_every=calibrate_every,
        warmup_steps=WARMUP,
    )
    engine = ActivationCompressor(policy, model=module)
    engine.install()
    policy.setup(module)
    batches = itertools.cycle(recipe.datamodule.train_dataloader())
    records = []
    try:
        for step in range(steps):
            x, y = _to(next(batches), device)
            optimizer.zero_grad(set_to_none=True)
            loss = compressed_step(
                engine,
                module,
                lambda x=x, y=y: F.cross_entropy(module.net(x), y.long()),
                step,
                inputs=(x, y),
            )
            metrics = policy.metrics()
            optimizer.step()
            records.append(
                {
                    "step": step,
                    "loss": round(float(loss.detach()), 5),
                    "ratio": round(engine.stats.ratio, 3),
                    **{k: round(v, 6) for k, v in metrics.items() if k != "calib_ms"},
                }
            )
    finally:
        engine.remove()
        policy.teardown()
    return records, recipe.description


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser)
    parser.add_argument("--errors", nargs="+", type=float, default=[0.01, 0.02, 0.05, 0.1, 0.2])
    parser.add_argument("--steps", type=int, default=None, help="per e; default 8 quick, 20")
    parser.add_argument("--trajectory-steps", type=int, default=None, help="default 60, 400")
    parser.add_argument("--calibrate-every", type=int, default=None, help="default 5, 20")
    args = parser.parse_args(argv)
    setup_threads(args)
    steps = args.steps or (8 if args.quick else 20)
    trajectory_steps = args.trajectory_steps or (60 if args.quick else 400)
    every = args.calibrate_every or (5 if args.quick else 20)

    tradeoff = []
    for e in args.errors:
        records, description = train_acgc(args, e, steps, calibrate_every=1)
        after = records[WARMUP:]
        errors = [r["grad_error"] for r in after]
        ratios = [r["ratio"] for r in after]
        tradeoff.append(
            {
                "gradient_error": e,
                "ratio": round(statistics.median(ratios), 3),
                "grad_error": round(statistics.median(errors), 5),
                "grad_error_max": round(max(errors), 5),
                "within": sum(err <= e for err in errors) / len(errors),
                "steps": len(after),
            }
        )
    records, description = train_acgc(args, 0.05, trajectory_steps, calibrate_every=every)
    trajectory = [r for r in records if "grad_error" in r]
    result = {
        "benchmark": "tradeoff",
        "mode": "quick" if args.quick else "full",
        "machine": machine(resolve_device(args.device)),
        "model": description,
        "tradeoff": tradeoff,
        "trajectory": {
            "gradient_error": 0.05,
            "calibrate_every": every,
            "steps": trajectory_steps,
            "calibrations": trajectory,
            "final_loss": records[-1]["loss"],
        },
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
