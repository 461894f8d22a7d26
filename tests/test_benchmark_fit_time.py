"""benchmarks/fit_time.py: plain and acgc side by side with the optimizer step; the
fit-time bar reads its full-size CPU line only."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from benchmarks._fit_tables import fit_time_bars, fit_time_table
from benchmarks._rounds import amortized
from benchmarks.fit_time import main


@pytest.fixture(scope="module")
def quick_gnn() -> dict[str, Any]:
    return main(["--quick", "--models", "gnn", "--rounds", "2", "--threads", "1"])


def test_a_quick_run_times_both_configurations_with_their_optimizer(quick_gnn: dict) -> None:
    info = quick_gnn["models"]["gnn"]
    plain, acgc = info["plain"], info["acgc"]
    assert info["optimizer"] in {"SGD", "AdamW"}
    for row in (plain, acgc):
        assert row["optimizer_s"] > 0 and row["grad_s"] > 0
        assert row["step_s"] >= row["grad_s"]
    assert acgc["calibrate_every"] == 100
    # a calibration step runs the exact pass as well: dearer than an ordinary step
    assert acgc["calibration_step_s"] > acgc["step_s"]
    assert acgc["fit_vs_plain"] > acgc["step_vs_plain"]
    assert acgc["fit_1000_vs_plain"] >= acgc["fit_vs_plain"] - 1e-3  # codecs built at first


def test_amortizing_adds_one_calibration_per_interval() -> None:
    assert amortized(1.0, 1.0, 1.0, 100) == 1.0
    assert amortized(1.0, 1.0, 11.0, 100) == 1.1
    assert amortized(1.25, 2.0, 2.0 + 2 * 100 * 0.04, 100) == 1.3


def test_the_table_and_bar_read_the_fit_ratio(quick_gnn: dict) -> None:
    rows = fit_time_table(quick_gnn)
    assert len(rows) == 3 and rows[2].count("|") == rows[0].count("|")
    assert fit_time_bars(quick_gnn) == ([], [])  # quick mode: no bar
    full = copy.deepcopy(quick_gnn)
    full["mode"] = "full"
    full["models"]["gnn"]["acgc"]["fit_vs_plain"] = 1.31
    met, short = fit_time_bars(full)
    assert not met and "fit time of GNN with acgc" in short[0] and "1.31x" in short[0]
    full["models"]["gnn"]["acgc"]["fit_vs_plain"] = 1.3
    met, short = fit_time_bars(full)
    assert not short and "1.30x plain" in met[0]
    full["machine"]["device"] = "cuda:0"
    assert fit_time_bars(full) == ([], [])  # the bar is a CPU one


def test_a_run_of_some_models_leaves_the_others_rows_standing(tmp_path: Path) -> None:
    """Storing a full line of some models keeps the replaced line's other models first,
    each row with its own commit; a quick line stays apart."""
    from benchmarks.run_all import read_results, store

    def line(mode: str, commit: str, models: list[str]) -> dict[str, Any]:
        info = {"plain": {}, "acgc": {"fit_vs_plain": 1.2}}
        return {"benchmark": "fit_time", "mode": mode, "commit": commit,
                "machine": {"device": "cpu"}, "models": {m: info for m in models}}  # fmt: skip

    store(line("full", "a1", ["resnet18", "bert_base"]), tmp_path)
    store(line("quick", "q1", ["gnn"]), tmp_path)
    store(line("full", "b2", ["bert_base", "llama_135m"]), tmp_path)
    store(line("full", "c3", ["gcn_256"]), tmp_path)
    quick, full = read_results(tmp_path / "fit_time.jsonl")
    assert full["commit"] == "c3" and list(quick["models"]) == ["gnn"]
    commits = {m: info["commit"] for m, info in full["models"].items()}
    assert commits == {"resnet18": "a1", "bert_base": "b2", "llama_135m": "b2", "gcn_256": "c3"}
    assert list(commits) == ["resnet18", "bert_base", "llama_135m", "gcn_256"]
