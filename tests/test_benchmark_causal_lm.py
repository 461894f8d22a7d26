"""benchmarks/causal_lm.py: the Hugging Face decoders measured side by side, and the
report's table made from its line."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks._tables import memory_time_table
from benchmarks.causal_lm import main

CONFIGS = ["plain", "checkpoint", "acgc", "quant2"]


@pytest.fixture(scope="module")
def quick_gpt2() -> dict[str, Any]:
    return main(
        ["--quick", "--models", "gpt2", "--rounds", "1", "--threads", "1", "--no-peak",
         "--configs", *CONFIGS]
    )  # fmt: skip


def test_each_configuration_is_measured_and_timed(quick_gpt2: dict) -> None:
    memory = quick_gpt2["memory"]["models"]["gpt2"]
    speed = quick_gpt2["speed"]["models"]["gpt2"]
    assert memory["family"] == "lm" and memory["description"].startswith("GPT-2 4x128")
    assert list(memory["configs"]) == list(speed["configs"]) == CONFIGS
    assert speed["configs"]["plain"]["vs_plain"] == 1.0
    assert all(row["step_ms"] > 0 for row in speed["configs"].values())


def test_checkpointing_is_exact_and_acgc_keeps_fewer_bytes_than_2_bit(quick_gpt2: dict) -> None:
    """Checkpointing each decoder layer recomputes the same gradient; acgc at its default
    keeps fewer bytes than fixed 2-bit at a smaller gradient error (on this model its
    remade tensors, GELU's and the Linear outputs, need no bytes at all)."""
    rows = quick_gpt2["memory"]["models"]["gpt2"]["configs"]
    assert rows["checkpoint"]["grad_error"] < 1e-6
    assert rows["checkpoint"]["kept_bytes"] < rows["plain"]["kept_bytes"] / 4
    assert rows["acgc"]["grad_error"] < min(0.05, rows["quant2"]["grad_error"])
    assert rows["acgc"]["kept_bytes"] < rows["quant2"]["kept_bytes"]


def test_the_report_table_reads_both_halves(quick_gpt2: dict) -> None:
    table = memory_time_table(quick_gpt2["memory"], quick_gpt2["speed"])
    assert table[0].startswith("| model | configuration")
    rows = table[2:]  # after the header and its separator: one row per configuration
    assert len(rows) == len(CONFIGS)
    assert rows[0].startswith("| GPT-2 4x128") and "| 1.00x |" in rows[0]
