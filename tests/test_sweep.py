"""``benchmarks/sweep.py``: paired-seed runs, interleaving, the summary and the plot."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

from benchmarks import sweep
from benchmarks.sweep import PLAIN, format_table, plot_sweep, read_runs, run_order, summarize


def test_run_order_pairs_every_config_with_every_seed_and_rotates() -> None:
    order = run_order(["a", "b"], [PLAIN, "x", "y"], [0, 1, 2])
    assert len(order) == len(set(order)) == 2 * 3 * 3
    firsts = [order[i][2] for i in range(0, 9, 3)]
    assert firsts == [PLAIN, "x", "y"]  # no configuration always runs first
    assert [o[0] for o in order] == ["a"] * 9 + ["b"] * 9


def _run(config: str, seed: int, loss: float, ratio: float = 1.0) -> dict:
    return {"recipe": "r", "config": config, "seed": seed, "val_loss": loss,
            "val_acc": 0.5, "ratio": ratio, "fit_seconds": 2.0}  # fmt: skip


def test_summary_pairs_by_seed_not_by_position() -> None:
    runs = [
        _run(PLAIN, 0, 2.0),
        _run(PLAIN, 1, 2.3),
        _run(PLAIN, 2, 2.1),
        _run("x", 2, 2.1, 8.0),  # listed out of order: paired by seed
        _run("x", 0, 2.0, 8.0),
        _run("x", 1, 2.3, 8.0),
        _run("bad", 0, 2.6, 14.0),
        _run("bad", 1, 2.9, 14.0),
        _run("bad", 2, 2.7, 14.0),
    ]
    rows = summarize(runs)["r"]
    assert rows["x"]["val_loss_diff"] == [0.0, 0.0, 0.0] and rows["x"]["within_spread"]
    assert rows["bad"]["val_loss_diff_mean"] == pytest.approx(0.6)
    assert rows["bad"]["plain_spread"] == pytest.approx(0.3)
    assert not rows["bad"]["within_spread"]
    assert rows["bad"]["ratio_mean"] == 14.0
    assert rows["bad"]["val_loss_diff_rel"] == pytest.approx(0.6 / 2.1333, abs=1e-4)
    assert rows[PLAIN]["val_loss_diff_mean"] == 0.0


def test_summary_keeps_the_latest_run_and_skips_unpaired_seeds() -> None:
    runs = [_run(PLAIN, 0, 2.0), _run(PLAIN, 1, 2.2), _run("x", 0, 3.0), _run("x", 0, 2.1),
            _run("x", 5, 9.0)]  # fmt: skip
    row = summarize(runs)["r"]["x"]
    assert row["seeds"] == [0] and row["val_loss_diff"] == [pytest.approx(0.1)]
    assert summarize([_run("x", 0, 2.0)]) == {}  # no plain runs: nothing to compare


def test_plot_writes_a_png(tmp_path: Path) -> None:
    runs = [_run(PLAIN, 0, 2.0), _run(PLAIN, 1, 2.2), _run("x", 0, 2.1, 8.0),
            _run("x", 1, 2.2, 8.0)]  # fmt: skip
    path = plot_sweep(summarize(runs), tmp_path / "docs" / "sweep.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # four short fits: about 10 s on 2 idle cores
def test_sweep_trains_paired_runs_and_writes_one_line_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = ["model=charlm", "model.hidden_size=16", "model.num_layers=1", "model.num_heads=2",
            "data.seq_len=16", "data.batch_size=8", "trainer.fast_dev_run=2"]  # fmt: skip
    monkeypatch.setitem(sweep.RECIPES, "charlm", tiny)
    out, png = tmp_path / "sweep.jsonl", tmp_path / "sweep.png"
    config = "compression=fixed compression.bits=2"
    common = ["--out", str(out), "--plot", str(png), "--recipes", "charlm"]
    result = sweep.main([*common, "--seeds", "0", "1", "--config", config])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["run"] * 4 + ["summary"]
    assert {(r["config"], r["seed"]) for r in lines[:4]} == {
        (c, s) for c in (PLAIN, config) for s in (0, 1)
    }
    assert all(r["commit"] and r["machine"]["date"] for r in lines[:4])
    rows = result["summary"]["charlm"]
    assert rows[config]["ratio_mean"] > 2 and rows[PLAIN]["ratio_mean"] == 1.0
    assert len(read_runs(out)) == 4 and png.exists()
    again = sweep.main(["--summarize", str(out), "--plot", str(png)])
    assert again["summary"] == result["summary"]
    assert len(out.read_text().splitlines()) == 5  # summarizing appends nothing


def test_table_has_one_row_per_recipe_and_configuration() -> None:
    runs = [_run(PLAIN, 0, 2.0), _run(PLAIN, 1, 2.2), _run("compression=x", 0, 2.5, 8.0),
            _run("compression=x", 1, 2.7, 8.0)]  # fmt: skip
    lines = format_table(summarize(runs)).splitlines()
    assert len(lines) == 4
    assert lines[3].startswith(
        "| r | x | 2 | 2.6000 | +0.5000 (+23.8%) ± 0.0000 | 0.2000 | no | 8.00x"
    )


def test_spread_and_fit_time_come_from_the_rows_own_seeds_and_sweep() -> None:
    """Plain's spread is taken on the seeds the configuration ran (a later plain seed far
    off does not widen it); the fit time is against plain's run of the same commit."""

    def run(config, seed, loss, seconds, commit):
        return {**_run(config, seed, loss), "fit_seconds": seconds, "commit": commit}

    runs = [
        run(PLAIN, 0, 2.0, 10.0, "old"),
        run(PLAIN, 1, 2.2, 10.0, "old"),
        run("x", 0, 2.1, 15.0, "old"),
        run("x", 1, 2.4, 15.0, "old"),
        run(PLAIN, 0, 2.0, 5.0, "new"),  # a later sweep on a faster machine
        run(PLAIN, 1, 2.2, 5.0, "new"),
        run(PLAIN, 2, 3.0, 5.0, "new"),
    ]
    row = summarize(runs)["r"]["x"]
    assert row["plain_spread"] == pytest.approx(0.2)
    assert row["fit_time_vs_plain"] == pytest.approx(1.5)
    assert row["val_loss_diff_se"] == pytest.approx(0.05)


def test_docstring_examples() -> None:
    assert doctest.testmod(sweep).failed == 0


def test_a_row_is_paired_with_plain_of_its_own_sweep() -> None:
    """A later sweep on a CPU of another make trains plain to other losses: an older
    row keeps the plain runs of its own commit and machine (its differences, spread and
    time), the new row gets the new plain runs."""

    def run(config, seed, loss, commit, cpu):
        machine = {"cpu": cpu, "date": f"2026-11-{20 + seed:02d}T00:00:00"}
        return {**_run(config, seed, loss), "commit": commit, "machine": machine}

    runs = [
        run(PLAIN, 0, 2.0, "old", "Intel"),
        run(PLAIN, 1, 2.2, "old", "Intel"),
        run("x", 0, 2.1, "old", "Intel"),
        run("x", 1, 2.3, "old", "Intel"),
        run(PLAIN, 0, 2.5, "new", "AMD"),
        run(PLAIN, 1, 2.9, "new", "AMD"),
        run("y", 0, 2.5, "new", "AMD"),
        run("y", 1, 2.8, "new", "AMD"),
    ]
    rows = summarize(runs)["r"]
    assert rows["x"]["val_loss_diff"] == [pytest.approx(0.1), pytest.approx(0.1)]
    assert rows["x"]["plain_spread"] == pytest.approx(0.2)
    assert rows["y"]["val_loss_diff"] == [pytest.approx(0.0), pytest.approx(-0.1)]
    assert rows["y"]["plain_spread"] == pytest.approx(0.4)
