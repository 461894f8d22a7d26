"""benchmarks/precision.py: acgc in float32 and bf16-mixed side by side, with the floor
pass and without, and the precision's own error from plain bf16."""

from __future__ import annotations

import pytest
import torch

from benchmarks._harness import build_recipe
from benchmarks.precision import CONFIGS, main, run_config


def test_each_precision_is_measured_at_the_same_weights() -> None:
    result = main(["--quick", "--models", "bert", "--calibrations", "3"])
    assert result["benchmark"] == "precision" and result["mode"] == "quick"
    rows = result["models"]["bert"]["configs"]
    assert set(rows) == set(CONFIGS)
    plain, fp32 = rows["bf16_plain"], rows["fp32"]
    assert plain["error"] == 0.0 and plain["ratio"] == 1.0  # its own exact gradient
    assert 0 < plain["error_vs_fp32"] < 0.5  # the precision's own error
    assert fp32["error"] == fp32["error_vs_fp32"] and "rounding_floor" not in fp32
    bf16 = rows["bf16"]
    assert len(bf16["grad_error"]) == 3 and len(bf16["rounding_floor"]) == 2  # from step 1
    assert "rounding_floor" not in rows["bf16_literal"]
    for row in rows.values():
        assert row["vs_fp32_plain"] == round(fp32["saved_mb"] / row["held_mb"], 3)
    assert bf16["ratio"] > 3 and fp32["ratio"] > 3


@pytest.mark.slow
def test_bf16_keeps_no_more_than_float32_where_the_floor_is_read() -> None:
    """The quick ResNet in bf16-mixed (BatchNorm in bf16: a rounding floor of ~0.5e): read
    as the codecs' error, κ ran to 17 and acgc held 1.8x float32's bytes; beyond the
    floor, no more than float32 acgc holds (of activations half as wide)."""
    recipe = build_recipe("resnet", True, torch.device("cpu"))
    rows = {c: run_config(recipe, c, 4) for c in ("fp32", "bf16", "bf16_literal")}
    assert rows["bf16"]["held_mb"] <= 1.1 * rows["fp32"]["held_mb"]
    assert rows["bf16_literal"]["held_mb"] > 1.3 * rows["bf16"]["held_mb"]
    assert rows["bf16"]["kappa"][-1] < 2 < rows["bf16_literal"]["kappa"][-1]
    assert all(0 < f < 0.05 for f in rows["bf16"]["rounding_floor"])
