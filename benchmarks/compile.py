"""Step time and compression ratio with ``torch.compile`` on and off.

A CNN (Conv, BatchNorm, ReLU, MaxPool) and a transformer block; for each, four
configurations: eager, eager + compression, compiled, compiled + compression (fixed
``quant`` 2-bit by default). A step is ``zero_grad`` + forward + backward. After warm-up
(compilation), every round runs every configuration once in turn; ``vs_eager`` is the
median over rounds of the step time divided by the eager step time of the same round.
Prints one JSON line.

    python -m benchmarks.compile [--rounds 9] [--bits 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import compress_activations


def _cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    return net, torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))


class _Transformer(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(
            dim, 4, 4 * dim, dropout=0.0, activation="gelu", batch_first=True
        )
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(tokens)).mean(dim=1))


def _transformer() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return _Transformer(), torch.randint(0, 256, (16, 64)), torch.randint(0, 2, (16,))


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {
    "cnn": _cnn,
    "transformer": _transformer,
}
CONFIGS = ("eager", "eager+quant", "compiled", "compiled+quant")


def _step(net: nn.Module, x: torch.Tensor, y: torch.Tensor, bits: int | None) -> float:
    """One step; returns the compression ratio (1.0 uncompressed)."""
    net.zero_grad(set_to_none=True)
    scope = (
        compress_activations(model=net, codec="quant", bits=bits)
        if bits
        else contextlib.nullcontext()
    )
    with scope as stats:
        F.cross_entropy(net(x), y).backward()
    return stats.ratio if stats is not None else 1.0


def measure(model: str, rounds: int, bits: int) -> dict[str, object]:
    torch.manual_seed(0)
    net, x, y = MODELS[model]()
    nets = {"eager": net, "compiled": torch.compile(net)}
    runs = {c: (nets[c.split("+")[0]], bits if "+quant" in c else None) for c in CONFIGS}
    ratios: dict[str, float] = {}
    compile_s: dict[str, float] = {}
    for name, (n, b) in runs.items():  # warm-up: compiles, and fills caches
        start = time.perf_counter()
        for _ in range(2):
            ratios[name] = _step(n, x, y, b)
        compile_s[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for r in range(rounds):
        order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]
        for name in order:
            n, b = runs[name]
            start = time.perf_counter()
            _step(n, x, y, b)
            times[name].append(time.perf_counter() - start)
    return {
        "step_ms": {c: round(1e3 * statistics.median(t), 2) for c, t in times.items()},
        "vs_eager": {
            c: round(statistics.median(a / e for a, e in zip(t, times["eager"], strict=True)), 3)
            for c, t in times.items()
        },
        "ratio": {c: round(ratios[c], 2) for c in CONFIGS},
        "warmup_s": {c: round(s, 1) for c, s in compile_s.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--bits", type=int, default=2, choices=[1, 2, 4, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = {
        "benchmark": "compile",
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": args.threads,
        "codec": f"quant bits={args.bits}",
        "rounds": args.rounds,
        "models": {m: measure(m, args.rounds, args.bits) for m in args.models},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
