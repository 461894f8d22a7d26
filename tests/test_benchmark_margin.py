"""benchmarks/margin.py: each target is measured side by side, the fixed settings once,
and the table marks the policy's default margin."""

from __future__ import annotations

from benchmarks._margin_tables import margin_table
from benchmarks.margin import main
from lightning_acgc.policies.acgc import ACGCPolicy


def test_a_looser_margin_is_measured_beside_the_default_and_keeps_no_less() -> None:
    result = main(["--quick", "--models", "gnn", "--recipes", "gnn", "--targets", "0.35", "0.6"])
    assert result["default_target"] == ACGCPolicy().target == 0.35
    gnn = result["models"]["gnn"]
    assert set(gnn["settings"]) == {"quant2", "quant4", "gact"}  # measured once, not per target
    for target in ("0.35", "0.6"):
        rows = gnn["acgc"][target]
        for setting, base in gnn["settings"].items():
            assert rows[setting]["ratio_share"] == round(rows[setting]["ratio"] / base["ratio"], 3)
            assert rows[setting]["error_target"] == round(min(base["grad_error"], 0.99), 4)
        assert rows["acgc_default"]["error_target"] == 0.05
        fits = result["fits"][target]
        assert fits["all"]["calibrations"] == fits["gnn"]["calibrations"] > 0
        assert fits["all"]["kept"] <= min(fits["all"]["global_kept"], fits["all"]["layer_kept"])
    # the margin is what it trades: the looser one keeps at least the default's memory
    loose, default = gnn["acgc"]["0.6"]["acgc_default"], gnn["acgc"]["0.35"]["acgc_default"]
    assert loose["ratio"] >= 0.98 * default["ratio"]
    assert result["fits"]["0.6"]["gnn"]["ratio"] >= 0.98 * result["fits"]["0.35"]["gnn"]["ratio"]
    table = margin_table(result)
    assert table[2].startswith("| 0.35 (default) | ") and table[3].startswith("| 0.6 | ")
