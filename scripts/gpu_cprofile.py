"""Python hot spots of a compressed step (cProfile, by own time): where the host time
of the hooks goes on the device the step runs on.

    python scripts/gpu_cprofile.py [--case resnet18] [--config quant2] [--device cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import build_case, make_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", default="resnet18")
    parser.add_argument("--configs", nargs="+", default=["quant2"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args()
    device = torch.device(args.device)
    recipe = build_case(args.case, args.quick, device, batch_size=args.batch_size)
    for config in args.configs:
        runner = make_runner(config, recipe)
        for step in range(4):
            runner.step(step)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            runner.step(5)
        if device.type == "cuda":
            torch.cuda.synchronize()
        profile.disable()
        print(f"==== {args.case} {config}: {args.steps} steps", flush=True)
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)
        runner.close()


if __name__ == "__main__":
    main()
