"""Throughput of every codec's encode and decode kernels next to a plain copy.

Prints one JSON line per codec, then one line that holds them all with the machine and
commit (what ``run_all`` stores): encode and decode GB/s counting bytes read plus bytes
written (input + payload for encode, payload + output for decode), for the Triton path
(CUDA only) and the torch reference, and the GB/s of a device-to-device copy of the same
tensor measured in the same run (read + write: the bandwidth ceiling). On CPU only the
torch path (and the copy) is measured. The Triton quant encode is the engine's: its
device check is read later (``quant_encode_deferred``), so calls queue back to back.

Run: ``python -m benchmarks.kernels --size 16777216 --repeat 20`` (add ``--relu`` for
post-ReLU activations, half zeros).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from collections.abc import Callable
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CODECS = ("quant", "mask", "bounded", "division")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], Any], repeat: int, device: torch.device) -> float:
    """Milliseconds a call of ``fn`` takes, after one warm-up call: on the CPU the median
    of ``repeat`` timed calls; on a GPU the median over 5 batches of ``repeat`` calls
    made back to back with one sync at the end (as a training step makes them: a call's
    host work overlaps the kernels queued before it; a call that waits for the device
    inside pays that wait), divided by ``repeat``."""
    fn()
    _sync(device)
    times = []
    for _ in range(5 if device.type == "cuda" else repeat):
        calls = repeat if device.type == "cuda" else 1
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def _nbytes(payload: dict[str, torch.Tensor] | torch.Tensor) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return sum(t.numel() * t.element_size() for t in payload.values())


def _gbps(nbytes: int, ms: float) -> float:
    return round(nbytes / (ms * 1e-3) / 1e9, 3)


def _codec_calls(
    codec: str, x: torch.Tensor, args: argparse.Namespace
) -> tuple[Callable[[str], Any], Callable[[Any, str], Any], torch.Tensor] | None:
    """(encode(backend), decode(payload, backend), the tensor encoded), or None where the
    codec's kernel module is missing."""
    shape, numel, dtype = x.shape, x.numel(), x.dtype
    if codec == "quant":
        from lightning_acgc.kernels.quant import quant_decode, quant_encode_deferred

        bits, group = args.bits, args.group_size

        return (  # the engine's encode: on the Triton path the verdict is read later
            lambda b: quant_encode_deferred(x, bits, group, 0, backend=b)[0],
            lambda p, b: quant_decode(p, bits, group, numel, dtype, backend=b),
            x,
        )
    if codec == "mask":
        from lightning_acgc.kernels.mask import mask_pack, mask_unpack

        m = x > 0
        return (lambda b: mask_pack(m, b), lambda p, b: mask_unpack(p, numel, b), m)
    try:
        mod = importlib.import_module(f"lightning_acgc.kernels.{codec}")
    except ModuleNotFoundError:
        return None
    if codec == "bounded":
        eb, group = args.error_bound, args.group_size
        return (
            lambda b: mod.bounded_encode(x, eb, group, True, backend=b),
            lambda p, b: mod.bounded_decode(p, group, numel, dtype, backend=b),
            x,
        )
    block, bits, group, low = args.block, args.bits, args.group_size, torch.bfloat16
    return (
        lambda b: mod.division_encode(x, block, bits, group, low, 0, backend=b),
        lambda p, b: mod.division_decode(p, shape, dtype, block, bits, group, backend=b),
        x,
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Measure every codec in ``args.codecs``; returns (and prints) one record each."""
    device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = _DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    batch = max(1, args.size // (64 * 32 * 32))
    x = torch.randn(batch, 64, 32, 32, generator=gen, device=device).to(dtype)  # NCHW
    if args.relu:
        x = x.clamp_(min=0)
    backends = ["triton", "torch"] if device.type == "cuda" else ["torch"]
    records = []
    for codec in args.codecs:
        calls = _codec_calls(codec, x, args)
        if calls is None:
            continue
        encode, decode, source = calls
        dst = torch.empty_like(source)
        copy_ms = _time_ms(lambda s=source, d=dst: d.copy_(s), args.repeat, device)
        record: dict[str, Any] = {
            "codec": codec,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "shape": list(x.shape),
            "copy_gbps": _gbps(2 * _nbytes(source), copy_ms),
            "copy_ms": round(copy_ms, 4),
        }
        for backend in backends:
            payload = encode(backend)
            packed = _nbytes(payload)
            out = decode(payload, backend)
            enc_ms = _time_ms(lambda e=encode, b=backend: e(b), args.repeat, device)
            dec_ms = _time_ms(lambda d=decode, p=payload, b=backend: d(p, b), args.repeat, device)
            record["packed_bytes"] = packed
            record[backend] = {
                "encode_gbps": _gbps(_nbytes(source) + packed, enc_ms),
                "decode_gbps": _gbps(packed + _nbytes(out), dec_ms),
                "encode_ms": round(enc_ms, 4),
                "decode_ms": round(dec_ms, 4),
            }
        print(json.dumps(record), flush=True)
        records.append(record)
    return records


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1 << 22, help="elements (NCHW, 64x32x32)")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls (median)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    parser.add_argument("--quick", action="store_true", help="a 1M-element tensor (smoke test)")
    parser.add_argument("--full", action="store_true", help="--size as given (the default)")
    parser.add_argument("--codecs", nargs="+", choices=_CODECS, default=list(_CODECS))
    parser.add_argument("--bits", type=int, default=2, help="quant bits / DIVISION residual bits")
    parser.add_argument("--group-size", type=int, default=256)
    parser.add_argument("--error-bound", type=float, default=1e-2, help="relative, bounded")
    parser.add_argument("--block", type=int, default=8, help="DIVISION pooling block")
    parser.add_argument("--relu", action="store_true", help="post-ReLU input (half zeros)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    from benchmarks._machine import emit, machine

    args = _parser().parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.size = min(args.size, 1 << 20)
    records = run(args)
    emit(
        {
            "benchmark": "kernels",
            "mode": "quick" if args.quick else "full",
            "machine": machine(torch.device(args.device)),
            "settings": {
                "size": args.size,
                "dtype": args.dtype,
                "bits": args.bits,
                "relu": args.relu,
                "repeat": args.repeat,
                # how _time_ms timed a call on this device
                "timing": "batched" if torch.device(args.device).type == "cuda" else "single",
            },
            "runs": records,
        }
    )


if __name__ == "__main__":
    main()
