"""Per-codec bytes and step time on a small ResNet-style CNN, measured side by side.

Prints one JSON line: for each codec, saved vs packed activation bytes of one training
step, and the median step time relative to plain training, with the configurations
interleaved in every round so that drift affects all alike.

    python benchmarks/codecs.py [--batch 64] [--width 32] [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from torch import nn

from lightning_acgc import compress_activations

CODECS: dict[str, dict] = {
    "identity": {"codec": "identity"},
    "quant8": {"codec": "quant", "bits": 8},
    "quant4": {"codec": "quant", "bits": 4},
    "quant2": {"codec": "quant", "bits": 2},
    "bounded_rel1e-2": {"codec": "bounded", "error_bound": 1e-2, "relative": True},
    "division": {"codec": "division"},
}


def make_cnn(width: int) -> nn.Module:
    def block(c_in: int, c_out: int, stride: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()
        )

    return nn.Sequential(
        block(3, width, 1),
        block(width, width, 1),
        block(width, 2 * width, 2),
        block(2 * width, 2 * width, 1),
        block(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = make_cnn(args.width)
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))

    def step(options: dict | None) -> dict:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if options is None:
            nn.functional.cross_entropy(model(x), y).backward()
            return {"time": time.perf_counter() - start}
        with compress_activations(model=model, **options) as stats:
            nn.functional.cross_entropy(model(x), y).backward()
        return {
            "time": time.perf_counter() - start,
            "saved": stats.saved_bytes,
            "packed": stats.packed_bytes,
        }

    configs: dict[str, dict | None] = {"plain": None, **CODECS}
    times: dict[str, list[float]] = {k: [] for k in configs}
    last: dict[str, dict] = {}
    for options in configs.values():  # warm-up
        step(options)
    for _ in range(args.rounds):
        for name, options in configs.items():
            last[name] = step(options)
            times[name].append(last[name]["time"])
    plain = statistics.median(times["plain"])
    result = {
        "benchmark": "codecs",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "model": f"cnn width {args.width}, batch {args.batch}, 32x32",
        "plain_step_ms": round(1e3 * plain, 2),
        "codecs": {
            name: {
                "saved_bytes": last[name]["saved"],
                "packed_bytes": last[name]["packed"],
                "ratio": round(last[name]["saved"] / last[name]["packed"], 2),
                "step_time_vs_plain": round(statistics.median(times[name]) / plain, 3),
            }
            for name in CODECS
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
