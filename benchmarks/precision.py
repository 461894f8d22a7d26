"""acgc in float32 and in bf16-mixed training, side by side, with and without its floor pass.

Under autocast (Lightning's ``precision="bf16-mixed"``) the activations are bf16: half the
bytes before any compression, and a backward that rounds every op's result to 8
significant bits. acgc reads its calibrations' errors beyond that rounding noise
(``rounding_floor``, :mod:`lightning_acgc.policies.acgc_rounding`); this script measures
what that changes. For each recipe model, each configuration on its own copy of the same
initial model and batch:

* ``fp32``: acgc at its default, float32;
* ``bf16``: acgc at its default under autocast (bf16 on the CPU and on CUDA);
* ``bf16_literal``: the same with ``rounding_floor=False`` (the error read as measured);
* ``bf16_plain``: no compression under autocast (the precision's own error).

Each runs ``--calibrations`` calibration steps on the batch, then one ordinary measured
step (no optimizer step: every configuration is measured at the same weights). Recorded per
configuration: the bytes plain autograd saves in its precision and the bytes held instead
(``held_mb``; ``ratio`` = the two's ratio; ``vs_fp32_plain``: float32 plain's saved bytes
over the bytes held, the memory a user saves against float32 training), the calibrations'
``grad_error``, ``rounding_floor`` and κ, and on the measured step the gradient's error
against the exact gradient of the same batch in its own precision (``error``) and against
the exact float32 gradient (``error_vs_fp32``: what the precision and the compression add
together; ``bf16_plain``'s is the precision's alone). The bytes do not depend on the
machine's load, so each configuration runs once.

Prints one JSON line.

    python -m benchmarks.precision [--quick] [--models resnet bert gnn] [--calibrations 6]
    python -m benchmarks.precision [--cases resnet50_imagenet bert_base gcn_256]

Full mode measures the recipes at their default sizes and, with ``--cases``, the size
presets of the memory and speed benchmarks (default: ResNet-50 at 224² and BERT-base,
generated images, as there; ``--cases`` alone: none). Not the GCN preset: its sparse
adjacency product has no bf16 kernel on the CPU (plain bf16 fails there too).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks._cases import CASES
from benchmarks._harness import (
    MODELS,
    Recipe,
    add_common_arguments,
    build_case,
    build_recipe,
    count_saved,
    emit,
    machine,
    make_runner,
    progress,
    resolve_device,
    setup_threads,
)
from lightning_acgc.engine.cycle import exact_gradients, no_side_effects

__all__ = ["CONFIGS", "relative_error", "run_config"]

# configuration -> (autocast to bf16, acgc's options; None: no compression)
CONFIGS: dict[str, tuple[bool, dict[str, Any] | None]] = {
    "fp32": (False, {}),
    "bf16": (True, {}),
    "bf16_literal": (True, {"rounding_floor": False}),
    "bf16_plain": (True, None),
}
MB = 2**20
CASES_MEASURED = ("resnet50_imagenet", "bert_base")  # full mode's default size presets


@contextlib.contextmanager
def _precision(bf16: bool, device: torch.device) -> Iterator[None]:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        yield


def relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """‖got − ref‖ / ‖ref‖ over the parameters both hold, in float64.

    Example:
        >>> relative_error({"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([1.0, 0.0])})
        1.0
    """
    num = sum(float((got[n].double() - r.double()).square().sum()) for n, r in ref.items())
    den = sum(float(r.double().square().sum()) for r in ref.values())
    return math.sqrt(num / den) if den > 0 else 0.0


def _gradient(module: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain gradient of ``loss()`` by parameter name, leaving no trace."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    with no_side_effects(module):
        grads = torch.autograd.grad(loss(), [p for _, p in named], allow_unused=True)
    return {n: g.detach() for (n, _), g in zip(named, grads, strict=True) if g is not None}


def run_config(recipe: Recipe, config: str, calibrations: int) -> dict[str, Any]:
    """One configuration's calibrations, then its measured step (module docstring)."""
    bf16, options = CONFIGS[config]
    device = next(recipe.module.parameters()).device
    acgc = None if options is None else {**options, "warmup_steps": calibrations}
    runner = make_runner("plain" if acgc is None else "acgc", recipe, acgc)
    module = runner.module
    loss = lambda: recipe.loss(module)
    calibration: list[dict[str, float]] = []
    try:
        for step in range(calibrations if options is not None else 0):
            with _precision(bf16, device):
                runner.step(step)
            calibration.append(runner.policy.metrics())  # type: ignore[union-attr]
        reference = _gradient(module, loss)  # float32's exact gradient
        with _precision(bf16, device):
            engine = runner.engine
            exact = exact_gradients(engine, module, loss) if engine else _gradient(module, loss)
            stats = runner.step(calibrations)
            got = {n: p.grad.detach() for n, p in module.named_parameters() if p.grad is not None}
            # plain: what autograd saves under this precision, all held
            saved = stats.saved_bytes if stats else count_saved(recipe, module)
            held = stats.packed_bytes if stats else saved
    finally:
        runner.close()
    row: dict[str, Any] = {
        "saved_mb": round(saved / MB, 3),
        "held_mb": round(held / MB, 3),
        "ratio": round(saved / held, 3) if held else None,
        "error": round(relative_error(got, exact), 5),
        "error_vs_fp32": round(relative_error(got, reference), 5),
    }
    for key in ("grad_error", "rounding_floor", "kappa", "layer_budget_use"):
        values = [m[key] for m in calibration if key in m]
        if values:
            row[key] = [round(v, 4) for v in values]
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--calibrations", type=int, default=6)
    parser.add_argument(
        "--cases",
        nargs="*",
        default=None,
        choices=list(CASES["full"]),
        help=f"full mode: size presets measured too (default: {' '.join(CASES_MEASURED)})",
    )
    args = parser.parse_args(argv)
    setup_threads(args)
    device = resolve_device(args.device)
    cases = [] if args.quick else list(CASES_MEASURED if args.cases is None else args.cases)
    models: dict[str, Any] = {}
    todo = [(name, build_recipe) for name in args.models] + [(c, build_case) for c in cases]
    for name, build in progress(todo, "models"):
        recipe = build(name, args.quick, device)
        rows = {c: run_config(recipe, c, args.calibrations) for c in CONFIGS}
        fp32_saved = rows["fp32"]["saved_mb"]
        for row in rows.values():
            row["vs_fp32_plain"] = round(fp32_saved / row["held_mb"], 3) if row["held_mb"] else None
        models[name] = {"description": recipe.description, "configs": rows}
    result = {
        "benchmark": "precision",
        "mode": "quick" if args.quick else "full",
        "calibrations": args.calibrations,
        "models": models,
        "machine": machine(device),
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
