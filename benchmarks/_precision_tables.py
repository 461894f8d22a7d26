"""README's table of ``benchmarks/precision.py``: acgc in float32 and in bf16-mixed, with
and without its floor pass, beside plain bf16, at the same weights."""

from __future__ import annotations

from typing import Any

__all__ = ["precision_table"]

LABELS = {
    "fp32": "acgc, float32",
    "bf16": "acgc, bf16-mixed",
    "bf16_literal": "acgc, bf16-mixed, `rounding_floor=False`",
    "bf16_plain": "plain, bf16-mixed",
}


def _last(row: dict[str, Any], key: str, fmt: str) -> str:
    values = row.get(key)
    return format(values[-1], fmt) if values else "–"


def precision_table(result: dict[str, Any] | None) -> list[str]:
    """One row per model and configuration: the bytes plain autograd saves in that
    precision and the bytes held, their ratio and float32 plain's saved bytes over the
    bytes held, the last calibration's κ and rounding floor, and the measured step's
    gradient error against its own precision's exact gradient and against float32's.

    Example:
        >>> row = {"saved_mb": 10.0, "held_mb": 1.0, "ratio": 10.0, "vs_fp32_plain": 20.0,
        ...        "error": 0.02, "error_vs_fp32": 0.03, "kappa": [0.5, 0.9]}
        >>> result = {"models": {"bert": {"description": "B", "configs": {"bf16": row}}}}
        >>> precision_table(result)[2]
        '| B | acgc, bf16-mixed | 10.0 → 1.00 | 10.0x | 20.0x | 0.90 | – | 0.020 | 0.030 |'
    """
    if not result:
        return []
    lines = [
        "| model | configuration | saved → held MB | ratio | vs float32 plain | κ | "
        "rounding floor | error | error vs float32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in result["models"].values():
        for config, row in model["configs"].items():
            vs = row.get("vs_fp32_plain")
            lines.append(
                f"| {model['description']} | {LABELS.get(config, config)} | "
                f"{row['saved_mb']:.1f} → {row['held_mb']:.2f} | {row['ratio']:.1f}x | "
                f"{'–' if vs is None else f'{vs:.1f}x'} | {_last(row, 'kappa', '.2f')} | "
                f"{_last(row, 'rounding_floor', '.3f')} | {row['error']:.3f} | "
                f"{row['error_vs_fp32']:.3f} |"
            )
    return lines
