"""README's GPU section: the result lines measured on a CUDA device (memory, speed,
codecs and the Triton kernels' throughput), kept apart from the CPU lines that the main
tables and the project's bars come from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks._codec_tables import codecs_table
from benchmarks._tables import machine_line, memory_time_table
from benchmarks.run_all import device_kind, read_results

__all__ = ["GPU_BENCHMARKS", "gpu_section", "is_gpu_line", "kernels_table", "load_gpu"]

GPU_BENCHMARKS = ("memory", "speed", "codecs", "kernels")


def is_gpu_line(row: dict[str, Any]) -> bool:
    """Whether a result line was measured on a CUDA device."""
    return device_kind(row) == "cuda"


def load_gpu(results: Path) -> dict[str, dict[str, Any]]:
    """Per benchmark, its last GPU line (a full one where there is one)."""
    out: dict[str, dict[str, Any]] = {}
    for name in GPU_BENCHMARKS:
        rows = [r for r in read_results(results / f"{name}.jsonl") if is_gpu_line(r)]
        rows.sort(key=lambda r: r.get("mode") == "full")
        if rows:
            out[name] = rows[-1]
    return out


def kernels_table(kernels: dict[str, Any]) -> list[str]:
    """Per codec: the Triton kernels' and the torch reference's GB/s beside a copy of the
    same tensor, and the kernel's time as a multiple of the copy's."""
    s = kernels["settings"]
    timing = (  # rows before e5297d3 have no "timing": single calls
        f"median over 5 batches of {s['repeat']} calls back to back, one sync a batch"
        if s.get("timing") == "batched"
        else f"median of {s['repeat']} calls"
    )
    out = [
        f"{s['size']:,} elements ({s['dtype']}{', post-ReLU' if s['relu'] else ''}), "
        f"{s['bits']}-bit quant and DIVISION residual, {timing}; GB/s counts bytes read "
        "plus written.",
        "",
        "| codec | copy GB/s | Triton encode GB/s (× copy time) | Triton decode GB/s "
        "(× copy time) | torch encode GB/s | torch decode GB/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in kernels["runs"]:
        tri, ref = r.get("triton", {}), r.get("torch", {})
        cells = []
        for k in ("encode", "decode"):
            if f"{k}_gbps" in tri:
                cells.append(f"{tri[f'{k}_gbps']:.0f} ({tri[f'{k}_ms'] / r['copy_ms']:.1f})")
            else:
                cells.append("–")
        out.append(
            f"| {r['codec']} | {r['copy_gbps']:.0f} | {cells[0]} | {cells[1]} | "
            f"{ref.get('encode_gbps', 0):.0f} | {ref.get('decode_gbps', 0):.0f} |"
        )
    return out


def _label(row: dict[str, Any]) -> str:
    text = f"commit {row.get('commit', 'unknown')}"
    if row.get("note"):
        text += f"; {row['note']}"
    return text


def gpu_section(results: Path) -> list[str]:
    """README's lines for the GPU results; none where nothing was measured on a GPU."""
    gpu = load_gpu(results)
    if not gpu:
        return []
    first = next(iter(gpu.values()))
    lines = [
        "### On a GPU",
        "",
        f"Measured on {machine_line(first['machine']).split('; load average')[0]}. "
        "`bash scripts/gpu_check.sh OUTDIR` runs the GPU tests and these benchmarks.",
        "",
    ]
    memory, speed = gpu.get("memory"), gpu.get("speed")
    if memory or speed:
        labels = [f"{n}: {_label(r)}" for n, r in (("memory", memory), ("speed", speed)) if r]
        lines += [
            "**Memory and time of one training step on a GPU** (step peak: "
            f"`torch.cuda.max_memory_allocated` during the step; {'. '.join(labels)}):",
            "",
            *memory_time_table(memory, speed),
            "",
        ]
    if "kernels" in gpu:
        lines += [
            f"**Triton kernels against a copy of the same tensor** ({_label(gpu['kernels'])}):",
            "",
            *kernels_table(gpu["kernels"]),
            "",
        ]
    if "codecs" in gpu:
        lines += [
            f"**Codec speed on a GPU** ({_label(gpu['codecs'])}):",
            "",
            *codecs_table(gpu["codecs"]),
            "",
        ]
    return lines
