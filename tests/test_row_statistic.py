"""A fused attention's log-sum-exp per query row (``F.scaled_dot_product_attention``'s
flash kernel on CPU) is kept as it is: its backward remakes the probabilities as
exp(s − lse), so an error in it scales whole rows (lightning_acgc.engine.sites.
is_row_statistic)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import ActivationCompressor, compressed_step
from lightning_acgc.policies import build_policy


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).sum()


def test_the_log_sum_exp_never_reaches_the_policy() -> None:
    """Every saved tensor but the log-sum-exp is the policy's to compress (fixed 2-bit
    here); it is kept, with its reason in the per-site table."""
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(8, 128, 32)
    policy = build_policy("fixed", codec="quant", bits=2)
    asked: list[tuple[int, ...]] = []
    codec_for = policy.codec_for
    policy.codec_for = lambda site, t: asked.append(tuple(t.shape)) or codec_for(site, t)
    engine = ActivationCompressor(policy, model=model)
    engine.install()
    try:
        compressed_step(engine, model, lambda: model(x), step=0)
    finally:
        engine.remove()
    kept = {r.shape: r.settings for r in engine.stats.sites.values() if r.codec == "kept"}
    assert kept.get((8, 2, 128)) == "row statistic"
    assert (8, 2, 128) not in asked
    assert (8, 2, 128, 16) in asked  # the queries, keys and values are the policy's
