"""A soak: 1,000 compressed steps with each policy on a small model. After every step
no saved bytes are live; after warm-up the process RSS does not grow (< 5%) and the
per-site tables keep their size."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import ActivationCompressor, build_policy, compressed_step
from lightning_acgc.engine import EngineSettings
from lightning_acgc.policies import available_policies, policy_class

pytestmark = pytest.mark.slow
STEPS = 1000
WARMUP = 200


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _policy(name: str):  # type: ignore[no-untyped-def]
    takes = "calibrate_every" in policy_class(name).options
    return build_policy(name, **({"calibrate_every": 50} if takes else {}))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
@pytest.mark.parametrize("name", available_policies())
def test_soak_1000_steps(name: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.LayerNorm(128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 8)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    policy = _policy(name)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=256))
    engine.install()
    policy.setup(model)
    g = torch.Generator().manual_seed(1)
    sizes: set[tuple[int, int, int]] = set()
    rss_warm = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add synchronization (and CI has 2 cores)
    try:
        for step in range(STEPS):
            # A fresh batch each step, as from a data loader (see test_ledger_with_held_input)
            x, y = torch.randn(32, 32, generator=g), torch.randint(0, 8, (32,), generator=g)
            opt.zero_grad()
            loss = compressed_step(
                engine, model, lambda x=x, y=y: F.cross_entropy(model(x), y), step
            )
            opt.step()
            del loss, x, y
            assert engine.stats.live_bytes == 0, f"step {step}: {engine.stats.live_bytes} live"
            if step >= WARMUP:
                sizes.add(
                    (len(engine.stats.sites), len(engine._site_hash), len(policy.site_settings()))
                )
            if step == WARMUP:
                rss_warm = _rss_bytes()
        rss_end = _rss_bytes()
    finally:
        torch.set_num_threads(threads)
        engine.remove()
    print(f"{name}: {STEPS} steps, RSS {rss_warm / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB")
    assert len(sizes) == 1, sizes
    assert rss_end < 1.05 * rss_warm, (rss_warm, rss_end)
    if name != "off":
        assert engine.stats.tensors_packed > 0


def test_ledger_with_held_input() -> None:
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 8))
    engine = ActivationCompressor(build_policy("fixed", codec="quant", bits=4), model=model)
    engine.install()
    x = torch.randn(16, 32)  # saved by the first Linear; tiny, so kept as it is
    try:
        engine.new_step(0)
        with engine.scope():
            loss = model(x).square().mean()
        loss.backward()
        del loss
        assert engine.stats.live_bytes == 0
    finally:
        engine.remove()
