"""Codec encode/decode time as a multiple of ``x.clone()`` of the same tensor.

For each codec setting and tensor size (fp32, post-ReLU: about half zeros), times
``codec.encode(x)``, ``codec.decode(packed)`` and ``x.clone()`` interleaved round by round,
so that drift and other load affect all three alike. Prints one JSON line: per setting and
size the median (and min) of encode and decode as a multiple of the clone's median (min;
the clone times of every setting with the same input pooled), and GB/s counting bytes
read plus written. ``mask`` takes ``x > 0``, ``intpack`` int64 max-pool indices of
about the same byte count, shaped as the pool saves them (:func:`pooling_indices`). Full
mode (the default): 4 MB and 64 MB, 21 rounds (the machine is shared: the median of 9 moved
by a third between runs); ``--quick``: 4 MB, 5 rounds. ``run_all`` stores the line in
``benchmarks/results/codecs.jsonl`` and ``report`` makes README's codec table from it.

    python -m benchmarks.codecs [--quick] [--sizes-mb 4 64] [--rounds 21] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._machine import (
    add_common_arguments,
    emit,
    machine,
    resolve_device,
    setup_threads,
    synchronize,
)
from lightning_acgc.codecs import build_codec
from lightning_acgc.codecs.quant import QuantWidthConfig
from lightning_acgc.codecs.split import SplitConfig

SETTINGS: dict[str, tuple[str, Any]] = {  # codec, its options (or config)
    "quant8": ("quant", {"bits": 8}),
    "quant4": ("quant", {"bits": 4}),
    "quant2": ("quant", {"bits": 2}),
    "quant1": ("quant", {"bits": 1}),
    # widths only policies choose (acgc): a bit stream of 8 codes in 3 (6) bytes
    "quant3": ("quant", QuantWidthConfig(bits=3)),
    "quant6": ("quant", QuantWidthConfig(bits=6)),
    "split2.5": ("split", SplitConfig(bits=3, low_share=0.5)),  # acgc's fractional widths
    # acgc's layout of a ReLU output: a mask bit a value, the non-zeros at 6 bits
    "nonzero6": ("nonzero", {"bits": 6, "meta": "bf16"}),
    "half": ("half", {}),  # float16: what acgc gives a tensor 8 bits cannot serve
    "bounded_rel1e-2": ("bounded", {"error_bound": 1e-2, "relative": True}),
    "division": ("division", {}),
    "mask": ("mask", {}),
    "intpack": ("intpack", {}),
}


def _time(fn: Callable[[], Any], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def pooling_indices(x: torch.Tensor) -> torch.Tensor:
    """int64 values of about the bytes of ``x`` (whole 56x56 planes) laid out as a stride-2
    3x3 max pool's argmax indices into 112x112 planes, shaped (planes, 56, 56) as the pool
    saves them: each output's window start plus an offset of 0-2 rows and 0-2 columns
    (ResNet's stem pool on ImageNet)."""
    m = max(round(x.numel() * x.element_size() / 8 / 3136), 1) * 3136
    gen = torch.Generator().manual_seed(1)
    out = torch.arange(m)
    row, col = out % 3136 // 56, out % 56  # 56x56 outputs per plane
    pick = torch.randint(0, 9, (m,), generator=gen)
    start = (2 * row + pick // 3).clamp(max=111) * 112 + (2 * col + pick % 3).clamp(max=111)
    return start.view(-1, 56, 56).to(x.device)


def _measure(name: str, x: torch.Tensor, rounds: int) -> dict[str, Any]:
    """Times of ``x.clone()``, encode and decode of setting ``name``, interleaved by round."""
    codec_name, options = SETTINGS[name]
    codec = build_codec(codec_name, options)
    if codec_name == "mask":
        x = x > 0
    elif codec_name == "intpack":
        x = pooling_indices(x)
    packed = codec.encode(x, seed=1)
    codec.decode(packed)  # warm-up
    x.clone()

    def encode(r: int) -> Any:
        # intpack's codec knows a storage it has packed (a second layer saving the same
        # indices costs nothing): each round packs with a fresh codec
        fresh = build_codec(codec_name, options) if codec_name == "intpack" else codec
        return fresh.encode(x, seed=r)

    times: dict[str, list[float]] = {"clone": [], "encode": [], "decode": []}
    for r in range(rounds):
        times["clone"].append(_time(x.clone, x.device))
        times["encode"].append(_time(lambda r=r: encode(r), x.device))
        times["decode"].append(_time(lambda: codec.decode(packed), x.device))
    raw = x.numel() * x.element_size()
    return {"times": times, "raw": raw, "packed": packed.nbytes, "input": str(x.dtype)}


def _summary(run: dict[str, Any], clones: list[float]) -> dict[str, Any]:
    """Ratios to the clone times ``clones`` of the same input (every setting's, pooled: a
    codec that frees large buffers leaves the allocator to fault in the next clone's pages,
    which made one setting's own clone 10x slower than the others'), and GB/s."""
    times, raw, packed = run["times"], run["raw"], run["packed"]
    moved = {"encode": raw + packed, "decode": raw + packed}
    med = {k: statistics.median(times[k]) for k in moved}
    low = {k: min(times[k]) for k in moved}
    clone_med, clone_low = statistics.median(clones), min(clones)
    out: dict[str, Any] = {"ratio": round(raw / packed, 2)}
    for k in ("encode", "decode"):
        out[f"{k}_x_clone"] = round(med[k] / clone_med, 2)
        out[f"{k}_x_clone_min"] = round(low[k] / clone_low, 2)
        out[f"{k}_gbps"] = round(moved[k] / med[k] / 1e9, 2)
    out["clone_gbps"] = round(2 * raw / clone_med / 1e9, 2)
    out["own_clone_gbps"] = round(2 * raw / statistics.median(times["clone"]) / 1e9, 2)
    return out


def measure_size(x: torch.Tensor, names: list[str], rounds: int) -> dict[str, Any]:
    """Every setting on ``x``, each against the pooled clone times of its input dtype."""
    runs = {name: _measure(name, x, rounds) for name in names}
    pooled: dict[str, list[float]] = {}
    for run in runs.values():
        pooled.setdefault(run["input"], []).extend(run["times"]["clone"])
    return {name: _summary(run, pooled[run["input"]]) for name, run in runs.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_arguments(parser)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=None, help="4 64; quick: 4")
    parser.add_argument("--rounds", type=int, default=None, help="default: 21; quick: 5")
    parser.add_argument("--only", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    if args.threads is None and not args.quick:
        args.threads = 2  # the CI machine's cores; --threads overrides
    setup_threads(args)
    sizes = args.sizes_mb or ([4] if args.quick else [4, 64])
    rounds = args.rounds or (5 if args.quick else 21)
    device = resolve_device(args.device)
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {
        "benchmark": "codecs",
        "mode": mode,
        "machine": machine(device),
        "threads": args.threads,
        "rounds": rounds,
        "tensor": "fp32 post-ReLU (randn then relu)",
        "sizes": {},
    }
    for mb in sizes:
        x = torch.randn(mb * 2**20 // 4, generator=gen).relu_().to(device)
        result["sizes"][f"{mb}MB"] = measure_size(x, args.only, rounds)
    emit(result)
    return result


if __name__ == "__main__":
    main()
