"""The model presets at published sizes (``configs/model/<preset>.yaml``): each composes
on top of its family's config, carries the published dimensions and builds a model that
runs a forward pass on a tiny input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hydra.utils import instantiate
from torch_geometric.data import Data

from recipes.config_schema import CONFIG_DIR, compose_config
from recipes.models import BertClassifier, GNNClassifier, HFCausalLM, ResNetClassifier

# preset -> (family's LightningModule, the fields it must set)
PRESETS: dict[str, tuple[type, dict[str, Any]]] = {
    "resnet18": (ResNetClassifier, {"depth": 18, "width": 1.0, "cifar_stem": True}),
    "resnet18_imagenet": (ResNetClassifier, {"depth": 18, "width": 1.0, "cifar_stem": False}),
    "resnet50": (ResNetClassifier, {"depth": 50, "width": 1.0, "cifar_stem": True}),
    "resnet50_imagenet": (ResNetClassifier, {"depth": 50, "width": 1.0, "cifar_stem": False}),
    "bert_base": (
        BertClassifier,
        {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "intermediate_size": 3072},
    ),
    "bert_small": (
        BertClassifier,
        {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "intermediate_size": 2048},
    ),
    "bert_mini": (
        BertClassifier,
        {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "intermediate_size": 1024},
    ),
    "gcn_256": (GNNClassifier, {"arch": "gcn", "num_layers": 3, "hidden_channels": 256}),
    "sage_256": (GNNClassifier, {"arch": "sage", "num_layers": 3, "hidden_channels": 256}),
    "gat_256": (GNNClassifier, {"arch": "gat", "num_layers": 3, "hidden_channels": 256}),
    "gpt2_small": (
        HFCausalLM,
        {"arch": "gpt2", "num_layers": 12, "hidden_size": 768, "num_heads": 12},
    ),
    "llama_135m": (
        HFCausalLM,
        {
            "arch": "llama",
            "num_layers": 30,
            "hidden_size": 576,
            "num_heads": 9,
            "num_kv_heads": 3,
            "intermediate_size": 1536,
        },
    ),
}

# published parameter counts of the bodies in millions, within 3% (no classifier head;
# BERT without its word embeddings and pooler, whose sizes follow the data's vocabulary;
# the language models without their token and position embeddings: GPT-2 small's 124.4M
# less 38.6M and 0.8M, SmolLM-135M's 134.5M less 28.3M)
BODY_PARAMS_M = {
    "resnet18": 11.2,
    "resnet50": 23.5,
    "bert_base": 85.6,
    "bert_small": 12.9,
    "gpt2_small": 85.0,
    "llama_135m": 106.2,
}


def test_every_preset_file_is_listed() -> None:
    families = {"resnet", "bert", "gnn", "charlm", "causal_lm"}
    files = {p.stem for p in (CONFIG_DIR / "model").glob("*.yaml")} - families
    assert files == set(PRESETS)


def _tiny_input(module: torch.nn.Module) -> Any:
    if isinstance(module, ResNetClassifier):
        return (torch.randn(2, module.hparams.in_channels, 64, 64), torch.zeros(2))
    if isinstance(module, BertClassifier):
        ids = torch.randint(0, module.hparams.vocab_size, (2, 128))
        return ids, torch.ones_like(ids), torch.zeros(2, dtype=torch.long)
    if isinstance(module, HFCausalLM):
        ids = torch.randint(0, module.num_classes, (2, 16))
        return ids, ids
    x = torch.randn(6, module.hparams.in_channels)
    edges = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]])
    mask = torch.ones(6, dtype=torch.bool)
    return Data(x=x, edge_index=edges, y=torch.zeros(6, dtype=torch.long), train_mask=mask)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_composes_builds_and_runs(preset: str) -> None:
    cls, fields = PRESETS[preset]
    cfg = compose_config([f"model={preset}"])
    for key, value in fields.items():
        assert cfg.model[key] == value, key
    module = instantiate(cfg.model).eval()
    assert isinstance(module, cls)
    with torch.no_grad():
        logits, _ = module.logits_and_targets(_tiny_input(module), "train")
    assert logits.shape[-1] == cfg.data.num_classes
    assert torch.isfinite(logits).all()
    body = preset.removesuffix("_imagenet")
    if body in BODY_PARAMS_M:
        skip = (".fc.", "classifier.", "word_embeddings", "pooler", "wte", "wpe", "embed_tokens")
        n = sum(p.numel() for k, p in module.named_parameters() if not any(s in k for s in skip))
        assert n / 1e6 == pytest.approx(BODY_PARAMS_M[body], rel=0.03), n


def test_gat_preset_splits_its_width_over_the_heads() -> None:
    cfg = compose_config(["model=gat_256"])
    module = instantiate(cfg.model)
    convs = module.net.convs
    assert len(convs) == 3
    assert convs[0].heads * convs[0].out_channels == 256
