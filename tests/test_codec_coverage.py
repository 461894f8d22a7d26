"""Coverage of the fixed 2-bit codec on the models of ``benchmarks/coverage.py``: integer
tensors (pooling indices, token indices and offsets, ``edge_index``) packed losslessly and
counted once, so that each model reaches its compression goal."""

from __future__ import annotations

import pytest

from benchmarks.coverage import GOALS, measure


@pytest.mark.parametrize("name", ["unet", "embbag"])
def test_models_reach_their_goal(name: str) -> None:
    ratio, table = measure(name)
    assert ratio >= GOALS[name], table


def test_gnn_reaches_its_goal() -> None:
    pytest.importorskip("torch_geometric")
    ratio, table = measure("gnn")
    assert ratio >= GOALS["gnn"], table
    assert "intpack" in table


def test_gru_small_tensors_compressed_below_the_default_threshold() -> None:
    ratio, table = measure("gru", min_numel=256)
    assert ratio >= GOALS["gru"], table
