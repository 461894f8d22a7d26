"""The Hugging Face causal LM recipe (``model=causal_lm``: GPT-2 and Llama decoders on
Python's documentation text): construction errors, the presets' dimensions, and fits
with acgc that end near plain's loss."""

from __future__ import annotations

import math

import pytest
import torch

from recipes.config_schema import compose_config
from recipes.models import HFCausalLM
from recipes.models.causal_lm import build_causal_lm
from recipes.train import train

QUIET = [
    "logger=false",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
# 2 x 32 decoders, windows of 32 characters: 64 steps of 16 windows, a few seconds
TINY = [
    "model=causal_lm",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "data.seq_len=32",
    "data.batch_size=16",
    "data.num_windows=1024",
    "trainer.max_epochs=1",
    "trainer.limit_val_batches=4",
]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"arch": "bert"}, r"arch='bert' is unknown; allowed values: \('gpt2', 'llama'\)"),
        ({"arch": "gpt2", "num_kv_heads": 2}, "GPT-2 has one key and value head"),
        ({"num_heads": 3}, "num_heads=3 must divide hidden_size=16"),
        ({"num_kv_heads": 3}, "num_kv_heads=3 must divide num_heads=4"),
        ({"num_layers": 0}, "num_layers=0 must be >= 1"),
        ({"attn_implementation": "flash"}, "attn_implementation='flash'"),
        ({"dropout": 1.0}, r"dropout=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_options_fail_at_construction(options: dict, message: str) -> None:
    sizes = {"hidden_size": 16, "num_layers": 1, "num_heads": 4}
    with pytest.raises(ValueError, match=message):
        HFCausalLM(num_classes=12, max_seq_len=8, **{**sizes, **options})


def test_the_presets_have_the_published_dimensions() -> None:
    gpt2 = compose_config(["model=gpt2_small"]).model
    assert (gpt2.arch, gpt2.hidden_size, gpt2.num_layers, gpt2.num_heads) == ("gpt2", 768, 12, 12)
    llama = compose_config(["model=llama_135m"]).model
    sizes = (llama.hidden_size, llama.num_layers, llama.num_heads, llama.num_kv_heads)
    assert (llama.arch, *sizes, llama.intermediate_size) == ("llama", 576, 30, 9, 3, 1536)
    net = build_causal_lm("llama", 128, 64, 576, 1, 9, 3, 1536)
    attention = net.model.layers[0].self_attn
    assert attention.k_proj.out_features == 3 * 64 and attention.q_proj.out_features == 576
    assert net.lm_head.weight is net.model.embed_tokens.weight  # tied, as in SmolLM


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_position_sees_only_the_past(arch: str) -> None:
    torch.manual_seed(0)
    module = HFCausalLM(12, 8, arch=arch, hidden_size=16, num_layers=1, num_heads=2).eval()
    x = torch.randint(0, 12, (1, 8))
    changed = x.clone()
    changed[0, 5] = (x[0, 5] + 1) % 12
    a, _ = module.logits_and_targets((x, x), "val")
    b, _ = module.logits_and_targets((changed, changed), "val")
    torch.testing.assert_close(a[:5], b[:5])
    assert not torch.allclose(a[5:], b[5:])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_acgc_fits_near_plain_with_fewer_bytes(arch: str) -> None:
    """The same seed and windows, plain and acgc: both learn (below the uniform guess's
    ln 128), acgc's validation loss within 2% of plain's, several times fewer bytes."""
    common = [*TINY, *QUIET, f"model.arch={arch}", "seed=3"]
    plain = train(compose_config([*common, "compression=none"]))
    acgc = train(compose_config([*common, "compression=acgc"]))
    assert plain["val/loss"] < math.log(128) - 1.0
    assert abs(acgc["val/loss"] - plain["val/loss"]) < 0.02 * plain["val/loss"]
    assert acgc["acgc/ratio"] > 5
