"""Largest batch that Lightning's batch-size tuner finds under one memory budget, without
and with compression.

Prints one JSON line. ``ActivationCompression(scale_batch_size=..., memory_budget=...)``
runs Lightning's own search twice in one fit: first with the ``identity`` codec (the
same hooks and budget accounting, nothing compressed: the plain batch size), then with
the policy. The budget counts live saved activations plus parameters, gradients and
optimizer state; it is set per model so that plain training fits about
``--plain-batch`` samples (from the saved bytes per sample of one plain step). The GNN
recipe trains on the whole graph (no batch dimension) and is left out.

``--quick``: ResNet and BERT at small sizes. Full: the full-width ResNet-18 (CIFAR stem,
digits in 3 channels) and BERT-mini (sequences of 128). On CPU both search by doubling
(``power``) for acgc and quant2, the budget fitting 48 plain samples (quick) or 8 (full:
a trial step at 16x that batch takes about a minute on 2 cores); on a GPU every policy,
``binsearch``, 48 samples.

    python -m benchmarks.batch [--quick] [--plain-batch 48] [--mode power|binsearch]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import torch
from lightning.pytorch import Trainer

from benchmarks._harness import (
    POLICIES,
    add_common_arguments,
    build_case,
    count_saved,
    emit,
    machine,
    resolve_device,
    setup_threads,
)
from lightning_acgc import ActivationCompression, CompressedBatchSizeFinder
from lightning_acgc.lightning.memory import static_memory_bytes

# the GNN recipe has no batch dimension
MODELS = {"quick": ("resnet", "bert"), "full": ("resnet18", "bert_mini")}
# the text task's default size, so that the search is not capped by a small data set
DATA = {"bert": ["data.num_samples=6000"], "bert_mini": ["data.num_samples=6000"]}
MB = 2**20


def budget_for(name: str, quick: bool, device: torch.device, plain_batch: int) -> dict[str, Any]:
    """A memory budget in which plain training fits about ``plain_batch`` samples."""
    recipe = build_case(name, quick, device, overrides=DATA.get(name, ()))
    batch_size = recipe.datamodule.batch_size
    per_sample = count_saved(recipe, recipe.module) / batch_size
    params = recipe.module.parameters()
    if recipe.cfg.model.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(params)
    static = static_memory_bytes(recipe.module, [optimizer])
    return {
        "description": recipe.description.rsplit(", batch", 1)[0],
        "saved_mb_per_sample": round(per_sample / MB, 4),
        "static_mb": round(static / MB, 3),
        "budget_bytes": int(static + per_sample * plain_batch),
    }


def search(
    name: str,
    config: str,
    budget: int,
    args: argparse.Namespace,
    device: torch.device,
    root_dir: str,
) -> dict[str, Any]:
    """One fit whose start runs the tuner without, then with compression."""
    recipe = build_case(name, args.quick, device, overrides=DATA.get(name, ()))
    policy, options = POLICIES[config]
    finder = CompressedBatchSizeFinder(
        args.mode, steps_per_trial=1, init_val=2, max_val=args.max_val
    )
    callback = ActivationCompression(
        policy,
        scale_batch_size=finder,
        memory_budget=budget,
        print_table=False,
        **options,
    )
    trainer = Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        max_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=root_dir,  # the tuner's temporary checkpoint goes here
    )
    trainer.fit(recipe.module, datamodule=recipe.datamodule)
    plain, found = finder.uncompressed_batch_size, finder.compressed_batch_size
    cap = len(recipe.datamodule.train_dataloader().dataset)
    return {
        "batch_size_uncompressed": plain,
        "batch_size": found,
        "gain": round(found / plain, 3) if plain and found else None,
        "capped_by_data": bool(found and found >= min(cap, args.max_val)),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser)
    parser.add_argument(
        "--models", nargs="+", help="default: resnet bert; full: resnet18 bert_mini"
    )
    parser.add_argument(
        "--configs", nargs="+", choices=list(POLICIES), help="default: all (CPU: acgc quant2)"
    )
    parser.add_argument("--plain-batch", type=int, help="default: 48 (full on CPU: 8)")
    parser.add_argument("--batch-size", type=int, help="ignored (run_all passes it on)")
    parser.add_argument("--mode", choices=("power", "binsearch"), help="default: power on CPU")
    parser.add_argument("--max-val", type=int, default=8192)
    args = parser.parse_args(argv)
    setup_threads(args)
    device = resolve_device(args.device)
    on_cpu = device.type == "cpu"
    mode = "quick" if args.quick else "full"
    args.models = args.models or list(MODELS[mode])
    if args.plain_batch is None:
        args.plain_batch = 8 if on_cpu and not args.quick else 48
    args.mode = args.mode or ("power" if args.quick or on_cpu else "binsearch")
    configs = args.configs or (["acgc", "quant2"] if args.quick or on_cpu else list(POLICIES))
    print(
        f"batch ({mode}): {args.models}, {configs}, {args.mode} search, budget for "
        f"{args.plain_batch} plain samples, {device}",
        file=sys.stderr,
    )
    models: dict[str, Any] = {}
    for name in args.models:
        info = budget_for(name, args.quick, device, args.plain_batch)
        info["budget_mb"] = round(info["budget_bytes"] / MB, 3)
        with tempfile.TemporaryDirectory() as root_dir:
            info["configs"] = {
                config: search(name, config, info["budget_bytes"], args, device, root_dir)
                for config in configs
            }
        models[name] = info
    result = {
        "benchmark": "batch",
        "mode": mode,
        "machine": machine(device),
        "search": args.mode,
        "plain_batch_target": args.plain_batch,
        "models": models,
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
