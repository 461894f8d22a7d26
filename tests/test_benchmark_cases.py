"""The benchmarks' cases: every full-size case composes from its preset, the sparse
adjacency computes the same model as ``edge_index``, and the memory benchmark's
gradient error is zero for an exact step and positive for a compressed one."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.data import Data

from benchmarks._cases import CASES, DEFAULT_CASES, FAMILIES, LM_CASES, sparse_adjacency
from benchmarks._harness import build_case, make_runner
from benchmarks.memory import _gradients, gradient_error
from recipes.config_schema import compose_config
from recipes.models import GNNClassifier


@pytest.mark.parametrize("name", sorted(CASES["full"]))
def test_full_case_composes_its_preset(name: str) -> None:
    case = CASES["full"][name]
    assert case.family in FAMILIES
    cfg = compose_config(case.compose_overrides())
    assert (
        f"model={name.removesuffix('_imagenet')}" in case.overrides[0] or name in case.overrides[0]
    )
    if case.batch_size is not None:
        assert cfg.data.batch_size == case.batch_size
    assert case.with_batch_size(3).batch_size == (None if case.batch_size is None else 3)


def test_default_cases_cover_every_family() -> None:
    """run_all's memory and speed measure one case of each recipe family; the causal-LM
    benchmark the language models."""
    for mode, names in DEFAULT_CASES.items():
        families = [CASES[mode][n].family for n in (*names, *LM_CASES[mode])]
        assert sorted(set(families)) == sorted(FAMILIES)
        assert {CASES[mode][n].family for n in LM_CASES[mode]} == {"lm"}


@pytest.mark.parametrize("arch", ["gcn", "sage"])
def test_sparse_adjacency_gives_the_same_logits(arch: str) -> None:
    torch.manual_seed(0)
    n = 40
    edges = torch.randint(0, n, (2, 200))
    edges = torch.cat([edges, edges.flip(0)], 1).unique(dim=1)
    # no self-loops, like the SBM graphs (GCN adds its own; on a sparse adjacency it
    # does not first drop existing ones as it does on edge_index)
    edges = edges[:, edges[0] != edges[1]]
    graph = Data(x=torch.randn(n, 8), edge_index=edges, y=torch.zeros(n, dtype=torch.long))
    graph.train_mask = torch.ones(n, dtype=torch.bool)
    module = GNNClassifier(num_classes=3, in_channels=8, arch=arch, num_layers=3).eval()
    dense, _ = module.logits_and_targets(graph, "train")
    sparse, _ = module.logits_and_targets(sparse_adjacency(graph), "train")
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-5)


def test_gradient_error_is_zero_when_exact_and_positive_when_compressed() -> None:
    recipe = build_case("gnn", quick=True, device=torch.device("cpu"))
    exact_runner = make_runner("plain", recipe)
    torch.manual_seed(1)
    exact_runner.step()
    exact = _gradients(exact_runner.module)
    checkpoint = make_runner("checkpoint", recipe)
    torch.manual_seed(1)
    checkpoint.step()
    assert gradient_error(exact, checkpoint) < 1e-6
    quant = make_runner("quant2", recipe)
    torch.manual_seed(1)
    quant.step()
    assert gradient_error(exact, quant) > 1e-3
    quant.close()


def test_checkpointing_counts_with_a_sparse_adjacency() -> None:
    """The full-size GNN cases pass a sparse CSR adjacency into every checkpointed layer
    (its storage cannot be read: it is the batch's graph, not an activation)."""
    import dataclasses

    from benchmarks._harness import checkpoint_blocks, count_saved, with_checkpointing

    recipe = build_case("gnn", quick=True, device=torch.device("cpu"))
    recipe = dataclasses.replace(recipe, batch=sparse_adjacency(recipe.batch))
    blocks = checkpoint_blocks(recipe.name, recipe.module)
    kept = count_saved(recipe, with_checkpointing(recipe.module, blocks), blocks)
    assert 0 < kept <= count_saved(recipe, recipe.module)
