"""Device and host time of the ``quant`` Triton kernels, the current ones side by side
with another version's (its ``triton_jit.py``, loaded from a file), on a GPU.

    python scripts/gpu_kernel_ab.py [--baseline OLD/triton_jit.py] [--size 16777216]

Device time: CUDA events around ``--launches`` back-to-back launches of one kernel (no
host sync between them, so the host's launch cost hides behind the kernel for large
tensors), interleaved variant by variant over ``--rounds`` rounds; the median and the
minimum per launch are reported, with a device-to-device copy of the same tensor as the
bandwidth ceiling. The encode also runs with injected noise (a second input read instead
of the Philox draw), which separates the cost of the noise from the rest.

Host time: microseconds a call spends on the host, per launch of the encode kernel
alone, per ``quant_encode_triton`` and ``quant_decode_triton`` call and per codec
encode/decode, on a small tensor (``--small`` values) where the device is idle.

Prints one JSON line per measured tensor and one for the host times. The baseline's
kernels must take the current launch arguments; a per-group status buffer of int32 and
an int32 float64 flag serve both layouts (an old kernel writes bytes into them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_acgc.codecs.quant import QuantCodec, QuantWidthConfig
from lightning_acgc.kernels.common.triton_utils import (
    LAUNCH_OPTIONS,
    interpreting,
    rows_per_program,
)
from lightning_acgc.kernels.quant import triton_jit as current
from lightning_acgc.kernels.quant.triton import quant_decode_triton, quant_encode_triton

GROUP = 256


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_quant_jit", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launchers(jit: ModuleType, x: torch.Tensor, bits: int, noise: torch.Tensor | None):
    """``(encode, decode, buffers)``: closures that launch ``jit``'s kernels once each on
    ``x``, and the tensors they write (``codes``, ``lo``, ``scale``, ``out``)."""
    numel = x.numel()
    n_groups = -(-numel // GROUP)
    gpp = rows_per_program(GROUP, n_groups)
    grid = (-(-n_groups // gpp),)
    codes = torch.empty(n_groups * GROUP * bits // 8, dtype=torch.uint8, device=x.device)
    lo = torch.empty(n_groups, dtype=torch.float32, device=x.device)
    scale = torch.empty_like(lo)
    status = torch.zeros(n_groups, dtype=torch.int32, device=x.device)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    out = torch.empty_like(x)

    def encode() -> None:
        jit._quant_encode_kernel[grid](
            x, noise if noise is not None else lo, codes, lo, scale, status, numel,
            n_groups, 1234, GROUP=GROUP, GROUP_P2=GROUP, BITS=bits, GPP=gpp,
            USE_NOISE=noise is not None, IDX64=False, INTERPRET=interpreting(), **LAUNCH_OPTIONS,
        )  # fmt: skip

    def decode() -> None:
        jit._quant_decode_kernel[grid](
            codes, lo, scale, flag,
            out.view(torch.int16) if out.dtype == torch.bfloat16 else out, numel, n_groups,
            GROUP=GROUP, GROUP_P2=GROUP, BITS=bits, GPP=gpp, IDX64=False,
            OUT_KIND={torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[out.dtype],
            **LAUNCH_OPTIONS,
        )  # fmt: skip

    return encode, decode, {"codes": codes, "lo": lo, "scale": scale, "out": out}


def _device_us(fn, launches: int) -> float:
    """Microseconds a launch of ``fn`` keeps the device busy (events around a batch)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        fn()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / launches


def _host_us(fn, calls: int) -> float:
    """Microseconds of host time a call of ``fn`` takes (the device idle: small tensor)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * seconds / calls


def _tensor_row(args: argparse.Namespace, variants: dict[str, ModuleType], dtype, bits) -> dict:
    x = torch.randn(args.size, device="cuda").relu_().to(dtype)
    noise = torch.rand(-(-x.numel() // GROUP), GROUP, device="cuda")
    fns: dict[str, Any] = {"copy": lambda: x.clone()}
    for name, jit in variants.items():
        enc, dec, _ = _launchers(jit, x, bits, None)
        enc()  # the payload the decode reads
        fns[f"{name}.encode"], fns[f"{name}.decode"] = enc, dec
        fns[f"{name}.encode_noise"] = _launchers(jit, x, bits, noise)[0]
    for fn in fns.values():  # compile and warm up
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for key, fn in fns.items():
            times[key].append(_device_us(fn, args.launches))
    copy_bytes = 2 * x.numel() * x.element_size()
    row: dict[str, Any] = {"dtype": str(dtype), "bits": bits, "numel": x.numel()}
    for key, ts in times.items():
        row[key] = {"median_us": round(statistics.median(ts), 2), "min_us": round(min(ts), 2)}
    best_copy = min(times["copy"])
    row["copy_gbps"] = round(copy_bytes / best_copy / 1e3, 1)
    for key in times:  # each kernel's minimum against the copy's
        row[key]["x_copy"] = round(min(times[key]) / best_copy, 2)
    return row


def _host_row(args: argparse.Namespace) -> dict:
    x = torch.randn(args.small, device="cuda").relu_()
    enc, _, _ = _launchers(current, x, 2, None)
    codec = QuantCodec(QuantWidthConfig(bits=2, group_size=GROUP))
    codec.backend = "triton"
    payload = quant_encode_triton(x, 2, GROUP, 1)
    packed = codec.encode(x, 1)
    fns = {
        "torch_add_": lambda: x.add_(0.0),
        "encode_launch": enc,
        "quant_encode_triton": lambda: quant_encode_triton(x, 2, GROUP, 1),
        "quant_decode_triton": lambda: quant_decode_triton(payload, 2, GROUP, x.numel(), x.dtype),
        "codec_encode": lambda: codec.encode(x, 1),
        "codec_decode": lambda: codec.decode(packed),
    }
    for fn in fns.values():
        fn()
    row: dict[str, Any] = {"host_us": {}, "numel": x.numel()}
    for key, fn in fns.items():
        row["host_us"][key] = round(min(_host_us(fn, args.calls) for _ in range(3)), 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", help="another version's quant triton_jit.py")
    parser.add_argument("--size", type=int, default=1 << 24)
    parser.add_argument("--small", type=int, default=1 << 12)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    variants = {"current": current}
    if args.baseline:
        variants["baseline"] = _load(args.baseline)
    for dtype, bits in ((torch.float32, 2), (torch.bfloat16, 4), (torch.float32, 8)):
        print(json.dumps(_tensor_row(args, variants, dtype, bits)), flush=True)
    print(json.dumps(_host_row(args)), flush=True)


if __name__ == "__main__":
    main()
