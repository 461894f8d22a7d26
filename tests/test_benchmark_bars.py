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


def test_acgc_with_checkpointing_is_held_against_checkpointing_alone() -> None:
    """Less memory than checkpointing alone and a measured error within e, or not met."""

    def memory(kept: float, err: float) -> dict[str, Any]:
        configs = {
            "checkpoint": {"kept_mb": 22.8},
            "acgc": {"kept_mb": 57.9},
            "acgc_checkpoint": {"kept_mb": kept, "grad_error": err},
        }
        return {"models": {"resnet18": {"configs": configs}}}

    times = {"plain": 1.0, "checkpoint": 1.35, "acgc": 1.1, "acgc_checkpoint": 1.48}
    met, short = bars({"speed": _speed(times), "memory": memory(9.7, 0.021)})
    line = "acgc with checkpointing vs checkpointing alone: 9.70 vs 22.80 MB kept"
    assert any(line in m and "1.48x vs 1.35x step time" in m for m in met)
    for kept, err in ((30.0, 0.02), (9.7, 0.08)):
        met, short = bars({"speed": _speed(times), "memory": memory(kept, err)})
        assert any("acgc with checkpointing" in s for s in short)


def test_speed_reads_the_amortized_calibration_against_the_fit_bar_at_full_size_only() -> None:
    speed = _speed({"plain": 1.0, "checkpoint": 1.34, "acgc": 1.2, "quant2": 1.08})
    speed["models"]["resnet18"]["configs"]["acgc"]["amortized_vs_plain"] = 1.33
    met, short = bars({"speed": speed})
    assert not any("calibration amortized" in line for line in met + short)  # not full size
    speed["mode"] = "full"
    met, short = bars({"speed": speed})
    line = "step time of resnet18 with acgc, calibration amortized"
    assert any(line in s and "1.33x" in s for s in short)
    speed["models"]["resnet18"]["configs"]["acgc"]["amortized_vs_plain"] = 1.29
    met, short = bars({"speed": speed})
    assert any(line in s and "1.29x" in s for s in met)
