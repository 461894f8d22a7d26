"""DDP with two CPU processes (gloo, spawn): compression on every rank, same settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _lightning_models import RankRecorder, TinyMLP, trainer_kwargs
from lightning.pytorch import Trainer

import lightning_acgc.lightning.strategy  # noqa: F401  (registers the acgc strategies)
from lightning_acgc.lightning.callback import ActivationCompression
from lightning_acgc.policies import available_policies

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


def _run(tmp_path: Path, strategy: str, *policy: str, **options: object) -> list[dict]:
    cb = ActivationCompression(*policy, print_table=False, **options)
    kwargs = trainer_kwargs(
        devices=2, strategy=strategy, max_epochs=2, deterministic=False, accumulate_grad_batches=2
    )
    trainer = Trainer(callbacks=[cb, RankRecorder(str(tmp_path))], **kwargs)
    trainer.fit(TinyMLP(batch_size=8))
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in records] == [0, 1]
    return records


def _check(records: list[dict], strategy_cls: str) -> None:
    for r in records:
        assert r["world_size"] == 2 and r["strategy"] == strategy_cls
        assert r["global_step"] == 4  # 64 samples / 2 ranks / 8 per batch / 2 accumulated
        assert r["tensors_packed"] > 0 and r["ratio"] > 2
        assert not r["hooks_after_step"]  # hooks live inside training_step only
        # every rank uses identical codec settings, checked by a gather on each rank
        assert len(set(r["digests"])) == 1
        assert len(set(r["checksums"])) == 1  # DDP kept the replicas equal
    assert records[0]["settings"] == records[1]["settings"]
    assert records[0]["digest"] == records[1]["digest"]


def test_acgc_ddp_spawn_trains_with_identical_settings(tmp_path: Path) -> None:
    """A calibrating policy (exact gradients averaged over ranks) when one is registered."""
    if "acgc" in available_policies():
        records = _run(tmp_path, "acgc_ddp_spawn", "acgc", gradient_error=0.1, calibrate_every=2)
        assert records[0]["policy_settings"] and records[0]["metrics"]["acgc/grad_error"] > 0
    else:
        records = _run(tmp_path, "acgc_ddp_spawn", codec="quant", bits=2)
    _check(records, "ACGCDDPStrategy")


@pytest.mark.slow
def test_callback_on_stock_ddp_spawn(tmp_path: Path) -> None:
    _check(_run(tmp_path, "ddp_spawn", codec="quant", bits=2), "DDPStrategy")
