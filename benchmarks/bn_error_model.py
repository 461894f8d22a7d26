"""acgc's error model of a BatchNorm's saved input against the error it causes.

For every ``--every``-th training-mode BatchNorm of a ResNet case: Gaussian noise of mean
variance v (channel c: v·var_c / mean var, as a 256-value rounding group scales with its
channel) in that BatchNorm's saved input alone, nothing else changed, and the weight
ops' summed gradient error ‖ĝ − g‖² read against the exact gradient of the same batch
(mean of ``--draws`` noise draws). Against it, per BatchNorm:

- ``model``: :mod:`lightning_acgc.policies.batch_norm_path`'s factors (one per weight op
  before it, both parts), times v;
- ``heuristic``: the factor the model had before (one layer, mean fan-in · ‖δ‖² ·
  mean(1/var)), times v.

Each as a ratio to the measured (1: exact; above: conservative). Prints one JSON line.

    python -m benchmarks.bn_error_model [--quick] [--every 5]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from torch import nn

from benchmarks._harness import (
    add_common_arguments,
    build_case,
    emit,
    machine,
    resolve_device,
    setup_threads,
)
from lightning_acgc.policies.batch_norm_path import BatchNormPaths
from lightning_acgc.policies.error_model import batch_norm_entries
from lightning_acgc.policies.gradient_stats import GradientStats


def _weight_grads(model: nn.Module, ops: list[str]) -> dict[str, torch.Tensor]:
    named = dict(model.named_modules())
    return {m: named[m].weight.grad.detach().clone() for m in ops}


def _noisy_step(recipe: Any, bn: nn.Module, noise: torch.Tensor) -> None:
    """One forward and backward with ``noise`` added to what ``bn`` saves as its input."""
    inside = [False]
    hooks = [
        bn.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True)),
        bn.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False)),
    ]

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t + noise if inside[0] and t.shape == noise.shape else t

    try:
        recipe.module.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = recipe.loss()
        loss.backward()
    finally:
        for h in hooks:
            h.remove()


def compare(case: str, quick: bool, device: torch.device, every: int, rel: float, draws: int):
    recipe = build_case(case, quick, device)
    model = recipe.module
    named = dict(model.named_modules())
    stats = GradientStats()
    stats.batch_norm = BatchNormPaths()
    stats.setup(model)
    inputs: dict[str, torch.Tensor] = {}
    bns = [n for n, m in named.items() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    keep = [named[n].register_forward_pre_hook(
        lambda m, a, n=n: inputs.__setitem__(n, a[0].detach())) for n in bns]  # fmt: skip
    stats.start()
    model.zero_grad(set_to_none=True)
    recipe.loss().backward()
    grad_sq = stats.stop()
    for h in keep:
        h.remove()
    ops = list(stats.fan_in)
    exact = _weight_grads(model, ops)
    grads = {f"{n}.{k}": p.grad for n, m in named.items()
             for k, p in m.named_parameters(recurse=False)}  # fmt: skip
    tables = stats.batch_norm_tables(grads, None)
    mean_fan_in = sum(stats.fan_in.values()) / len(stats.fan_in)
    rows = []
    for name in bns[::every]:
        x = inputs[name]
        channels = x.shape[1]
        var = x.float().transpose(0, 1).reshape(channels, -1).var(1, unbiased=False)
        v = rel**2 * float(var.mean())
        shape = (1, channels, *([1] * (x.dim() - 2)))
        measured = 0.0
        for draw in range(draws):
            torch.manual_seed(draw)
            noise = torch.randn_like(x) * (v * var / var.mean()).sqrt().view(shape).to(x.dtype)
            _noisy_step(recipe, named[name], noise)
            noisy = _weight_grads(model, ops)
            measured += sum(float((noisy[m] - exact[m]).square().sum()) for m in ops) / draws
        model_err = sum(batch_norm_entries(tables[name], tables, stats.fan_in, grad_sq).values())
        heuristic = mean_fan_in * grad_sq[name] * float((1 / var).mean()) * v
        rows.append({
            "batch_norm": name,
            "measured": measured,
            "model": round(model_err * v / measured, 3),
            "heuristic": round(heuristic / measured, 3),
        })  # fmt: skip
    return recipe.description, rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser)
    parser.add_argument("--every", type=int, default=None, help="default 1 quick, 5 full")
    parser.add_argument("--relative", type=float, default=0.1, help="noise std / channel std")
    parser.add_argument("--draws", type=int, default=2)
    args = parser.parse_args(argv)
    setup_threads(args)
    device = resolve_device(args.device)
    case = "resnet" if args.quick else "resnet50_imagenet"
    every = args.every or (1 if args.quick else 5)
    description, rows = compare(case, args.quick, device, every, args.relative, args.draws)
    ratios = {k: [r[k] for r in rows] for k in ("model", "heuristic")}
    result = {
        "benchmark": "bn_error_model",
        "mode": "quick" if args.quick else "full",
        "machine": machine(device),
        "model": description,
        "batch_norms": rows,
        "summary": {
            k: {"min": min(v), "median": statistics.median(v), "max": max(v)}
            for k, v in ratios.items()
        },
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
