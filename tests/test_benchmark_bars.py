"""The step-time bars of ``benchmarks/_tables.py``: fixed 2-bit against its own bar, and
a model that only the speed benchmark measures compared with checkpointing on time."""

from __future__ import annotations

from typing import Any

from benchmarks._tables import bars, memory_time_table


def _speed(configs: dict[str, float]) -> dict[str, Any]:
    return {
        "machine": {"device": "cpu"},
        "models": {
            "resnet18": {
                "description": "ResNet-18 x1, batch 64",
                "configs": {c: {"vs_plain": t} for c, t in configs.items()},
            }
        },
    }


def test_fixed_two_bit_and_checkpointing_bars_follow_the_numbers() -> None:
    met, short = bars(
        {"speed": _speed({"plain": 1.0, "checkpoint": 1.34, "acgc": 1.06, "quant2": 1.08})}
    )
    assert any("fixed 2-bit: 1.08x plain" in line for line in met)
    assert any("against checkpointing's 1.34x" in line for line in met)
    met, short = bars(
        {"speed": _speed({"plain": 1.0, "checkpoint": 1.1, "acgc": 1.06, "quant2": 1.22})}
    )
    assert any("fixed 2-bit: 1.22x plain" in line for line in short)
    assert any("against checkpointing's 1.10x" in line for line in short)


def test_a_speed_only_model_gets_rows_after_the_memory_benchmarks_models() -> None:
    memory = {"models": {"gcn": {"description": "GCN", "configs": {"plain": {}}}}}
    rows = memory_time_table(memory, _speed({"plain": 1.0, "checkpoint": 1.34, "quant2": 1.08}))
    names = [row.split(" | ")[0] for row in rows[2:] if not row.startswith("|  |")]
    assert names == ["| GCN", "| ResNet-18 x1, batch 64"]
    assert any("| checkpoint | – | – | – | 1.34x |" in row for row in rows)
