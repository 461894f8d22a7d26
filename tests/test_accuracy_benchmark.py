"""benchmarks/accuracy.py pairs each configuration's validation loss with plain's on the
same seed, and the report shows it and checks it against plain's seed-to-seed spread.
The recipe fits are replaced by a function of (configuration, seed): what is tested is
the bookkeeping, not training."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import accuracy
from benchmarks._tables import accuracy_table, bars

# plain's validation loss per seed; acgc's is plain's + 0.01 on every seed
PLAIN_LOSS = {0: 0.50, 1: 0.60, 2: 0.70}


def fake_train(cfg: Any) -> dict[str, float]:
    name = "none" if cfg.compression is None else cfg.compression.policy
    plain = PLAIN_LOSS[cfg.seed]
    loss = plain if name == "none" else plain + 0.01
    ratio = 1.0 if name == "none" else 12.0
    return {"val/acc": 1.0 - loss, "val/loss": loss, "acgc/ratio": ratio, "fit_seconds": 1.0}


@pytest.fixture
def result(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    import recipes.train

    monkeypatch.setattr(recipes.train, "train", fake_train)
    monkeypatch.setattr(accuracy, "emit", lambda result: None)
    return accuracy.main(
        ["--models", "gnn", "--configs", "acgc", "plain", "--seeds", "0", "1", "2"]
    )


def test_losses_are_paired_seed_by_seed(result: dict[str, Any]) -> None:
    rows = result["models"]["gnn"]["configs"]
    assert list(rows) == ["plain", "acgc"]  # plain first whatever the order asked
    assert rows["plain"]["loss_diff"] == 0.0
    assert rows["acgc"]["val_loss"] == [0.51, 0.61, 0.71]
    # the seeds differ by 0.2 from each other; paired, acgc differs by 0.01 exactly
    assert rows["acgc"]["loss_diff"] == pytest.approx(0.01)
    assert rows["acgc"]["loss_diff_se"] == pytest.approx(0.0, abs=1e-5)
    assert rows["acgc"]["loss"]["max"] - rows["acgc"]["loss"]["min"] == pytest.approx(0.2)


def test_the_table_and_the_bar_read_the_paired_loss(result: dict[str, Any]) -> None:
    text = "\n".join(accuracy_table(result))
    assert "+0.0100 ± 0.0000 | yes | 12.0x |" in text
    met, short = bars({"accuracy": result})
    (line,) = [m for m in met if m.startswith("validation loss of")]
    assert "+0.0100" in line and "spread 0.2000" in line
    # a paired difference wider than plain's spread is a bar not met
    result["models"]["gnn"]["configs"]["acgc"]["loss_diff"] = 0.25
    met, short = bars({"accuracy": result})
    assert any(s.startswith("validation loss of") for s in short)
    assert "+0.2500 ± 0.0000 | no |" in "\n".join(accuracy_table(result))


def test_results_without_losses_still_render(result: dict[str, Any]) -> None:
    for row in result["models"]["gnn"]["configs"].values():
        for key in ("val_loss", "loss", "loss_diff", "loss_diff_se"):
            row.pop(key)
    text = "\n".join(accuracy_table(result))
    assert "| – | – | – | 12.0x |" in text
    met, short = bars({"accuracy": result})
    assert not any(line.startswith("validation loss of") for line in met + short)
