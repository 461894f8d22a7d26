"""Which technology runs the CPU codecs: one 2-bit quantizer written several ways.

The CPU codecs run as a small C/OpenMP library (``kernels/common/csrc``). This measures
that choice against the alternatives, side by side in one run, on the same job: the
encode of fixed 2-bit ``quant`` (groups of 256, float32 metadata, seeded stochastic
rounding by the counter hash) of a float32 tensor of signed normal values (so that no
group keeps its zeros: the shortest form of the job). Every implementation's codes are
checked byte for byte against the reference's.

* ``reference``: the pure-torch specification (``quant_encode_ref``), eager, with its
  checks (non-finite values, wide ranges) and general paths;
* ``torch_ops``: the same arithmetic as one straight function of torch ops, nothing
  checked: better-organized eager torch;
* ``inductor``: that function through ``torch.compile`` (Inductor's CPU code generation);
* ``numba``: a ``numba.njit(parallel=True)`` loop, where numba is installed (it is no
  dependency of the project: ``pip install numba`` to measure it);
* ``c``: the project's kernel (``quant_encode_cpu``, the C/OpenMP library).

Each is timed as a multiple of ``x.clone()`` of the same tensor, the configurations
interleaved round by round; medians and minima over rounds. Prints one JSON line.

    python -m benchmarks.cpu_backends [--quick] [--size-mb 4] [--rounds 21] [--threads 2]

Full mode (the default): 4 MB, 21 rounds; ``--quick``: 1 MB, 5 rounds. ``run_all`` stores
the line in ``benchmarks/results/cpu_backends.jsonl`` and ``report`` puts its table under
README's codec table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._machine import add_common_arguments, emit, machine, setup_threads
from lightning_acgc.kernels.quant.cpu import quant_encode_cpu
from lightning_acgc.kernels.quant.reference import (
    _lowbias32,
    _lowbias32_t,
    hash_key,
    quant_encode_ref,
)

GROUP, BITS, TOP = 256, 2, 3.0
NOISE_UNIT = 2.0**-16


def _sig(value: float) -> float:
    """``value`` to 3 significant digits.

    Example:
        >>> _sig(0.0012345), _sig(60.874)
        (0.00123, 60.9)
    """
    return float(f"{value:.3g}")


def quant2_torch(xg: torch.Tensor, kh: int) -> torch.Tensor:
    """The 2-bit codes of ``xg`` (groups as rows of 256, float32, finite) as torch ops:
    ``quant_encode_ref``'s arithmetic for that case, with its hash key ``kh`` (the pair
    counter's high half hashed; the pairs of a tensor under 2**32 pairs).

    Example:
        >>> xg = torch.randn(2, GROUP)
        >>> kh = _lowbias32(hash_key(5))
        >>> ref = quant_encode_ref(xg.view(-1), BITS, GROUP, seed=5)["codes"]
        >>> torch.equal(quant2_torch(xg, kh), ref)
        True
    """
    lo, hi = xg.amin(dim=1), xg.amax(dim=1)
    step = (hi - lo) / TOP
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    pair = torch.arange(xg.numel() // 2, dtype=torch.int64, device=xg.device)
    h = _lowbias32_t(pair ^ kh)
    noise = torch.stack([h & 0xFFFF, h >> 16], dim=1).view(xg.shape).to(torch.float32)
    t = (xg - lo[:, None]) * inv[:, None] + noise * NOISE_UNIT
    q = t.clamp(min=0.0, max=TOP).to(torch.uint8).view(-1, 4)
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def numba_encoder() -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """A numba (``njit``, ``prange`` over groups) twin of :func:`quant2_torch`, or None
    where numba is not installed."""
    try:
        import numba
        import numpy as np
    except ImportError:
        return None
    m32, one6, f32 = np.uint64(0xFFFFFFFF), np.uint64(16), np.float32

    @numba.njit(inline="always")
    def lowbias32(x: Any) -> Any:
        x ^= x >> one6
        x = (x * np.uint64(0x7FEB352D)) & m32
        x ^= x >> np.uint64(15)
        x = (x * np.uint64(0x846CA68B)) & m32
        return x ^ (x >> one6)

    @numba.njit(parallel=True)
    def encode(x: Any, kh: Any, codes: Any) -> None:
        for g in numba.prange(x.shape[0]):
            lo, hi = x[g, 0], x[g, 0]
            for j in range(1, x.shape[1]):
                lo, hi = min(lo, x[g, j]), max(hi, x[g, j])
            step = f32(f32(hi - lo) / f32(TOP))
            inv = f32(f32(1.0) / step) if step > 0 else f32(0.0)
            for b in range(x.shape[1] // 4):
                byte = 0
                for pair in range(2):
                    j = 4 * b + 2 * pair
                    h = lowbias32(np.uint64((g * x.shape[1] + j) >> 1) ^ kh)
                    for k in range(2):
                        u = f32(
                            f32((h >> (one6 * np.uint64(k))) & np.uint64(0xFFFF)) * f32(NOISE_UNIT)
                        )
                        t = f32(f32(x[g, j + k] - lo) * inv) + u
                        t = min(max(t, f32(0.0)), f32(TOP))
                        byte |= int(t) << (2 * (2 * pair + k))
                codes[g * (x.shape[1] // 4) + b] = byte

    def run(xg: torch.Tensor, kh: int) -> torch.Tensor:
        codes = torch.empty(xg.numel() // 4, dtype=torch.uint8)
        encode(xg.numpy(), np.uint64(kh), codes.numpy())
        return codes

    return run


def implementations(seed: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each available implementation: (groups of 256 as rows) -> the 2-bit codes."""
    kh = _lowbias32(hash_key(seed))
    compiled = torch.compile(quant2_torch, dynamic=False)
    impls: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "reference": lambda xg: quant_encode_ref(xg.view(-1), BITS, GROUP, seed)["codes"],
        "torch_ops": lambda xg: quant2_torch(xg, kh),
        "inductor": lambda xg: compiled(xg, kh),
        "c": lambda xg: quant_encode_cpu(xg.view(-1), BITS, GROUP, seed)["codes"],
    }
    numba_run = numba_encoder()
    if numba_run is not None:
        impls["numba"] = lambda xg: numba_run(xg, kh)
    return impls


def _numba_status() -> str:
    try:
        import numba
    except ImportError:
        return "not installed"
    return f"numba {numba.__version__} (installed for the measurement; no dependency)"


def measure(size_mb: float, rounds: int, seed: int = 7) -> dict[str, Any]:
    """Per implementation: whether its codes match the reference's, and its time as a
    multiple of the clone's (median, min) with its GB/s (bytes read plus written)."""
    gen = torch.Generator().manual_seed(0)
    n = int(size_mb * 2**20) // 4 // GROUP * GROUP
    xg = torch.randn(n, generator=gen).view(-1, GROUP)
    impls = implementations(seed)
    expected = impls["reference"](xg)
    # also the warm-up: Inductor and numba compile on their first call
    matches = {name: bool(torch.equal(fn(xg), expected)) for name, fn in impls.items()}
    times: dict[str, list[float]] = {name: [] for name in ("clone", *impls)}
    jobs = {"clone": xg.clone, **{name: (lambda f=fn: f(xg)) for name, fn in impls.items()}}
    order = list(jobs)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            start = time.perf_counter()
            jobs[name]()
            times[name].append(time.perf_counter() - start)
    clone_med, clone_min = statistics.median(times["clone"]), min(times["clone"])
    moved = xg.numel() * 4 + xg.numel() * BITS // 8 + xg.shape[0] * 8
    rows = {
        name: {
            "matches_reference": matches[name],
            # 3 significant digits: a slow path on a loaded machine is not rounded to 0
            "x_clone": _sig(statistics.median(times[name]) / clone_med),
            "x_clone_min": _sig(min(times[name]) / clone_min),
            "gbps": _sig(moved / statistics.median(times[name]) / 1e9),
        }
        for name in impls
    }
    return {
        "tensor_mb": round(xg.numel() * 4 / 2**20, 2),
        "clone_gbps": round(2 * xg.numel() * 4 / clone_med / 1e9, 2),
        "implementations": rows,
        "numba": _numba_status(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)  # --device is taken and ignored: CPU implementations
    parser.add_argument("--size-mb", type=float, default=None, help="4 (full), 1 (quick)")
    parser.add_argument("--rounds", type=int, default=None, help="21 (full), 5 (quick)")
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = 2  # the codec benchmark's threads, in both modes
    setup_threads(args)
    size_mb = args.size_mb or (1.0 if args.quick else 4.0)
    rounds = args.rounds or (5 if args.quick else 21)
    result = {
        "benchmark": "cpu_backends",
        "mode": "quick" if args.quick else "full",
        "job": "quant encode, 2 bits, groups of 256, float32 metadata, signed normal values",
        "machine": machine(torch.device("cpu")),
        "threads": args.threads,
        "rounds": rounds,
        **measure(size_mb, rounds),
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
