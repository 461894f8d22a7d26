"""Plain vs compressed training of the ResNet recipe on digits, side by side.

Trains ``experiment=compare_digits`` (ResNet-18 at width 1/8 on scikit-learn's digits
upscaled to 32x32, 3 epochs) twice in one process: without compression and with the
adaptive policy (``acgc``; ``fixed`` where this install has no ``acgc`` yet), then
prints the final validation accuracy, the activation memory of one training step
(saved by autograd vs kept after compression) and the ratio. Offline, a few minutes
on 2 CPU cores. Hydra overrides after the options apply to both runs::

    python -m recipes.compare
    python -m recipes.compare --compression gact trainer.max_epochs=5 model.width=0.25
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.nn import functional as F

from lightning_acgc import compress_activations
from lightning_acgc.kernels.common.cpu_lib import cpu_library
from lightning_acgc.policies import OffPolicy, available_policies
from recipes.config_schema import compose_config
from recipes.train import RATIO_KEY, train

__all__ = ["compare", "compose_runs", "format_table", "main", "saved_activation_bytes"]

EXPERIMENT = "compare_digits"
DEFAULT_POLICY = "acgc"
FALLBACK_POLICY = "fixed"
SAVED_KEY, PACKED_KEY = "acgc/saved_mb", "acgc/packed_mb"  # logged by ActivationCompression


def saved_activation_bytes(cfg: DictConfig) -> int:
    """Bytes autograd saves for backward in one training step of ``cfg``'s recipe.

    Measured by the engine's meter with nothing compressed (the ``off`` policy, masks
    kept): one forward and backward on the first training batch of a fresh model.
    """
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    module = instantiate(cfg.model).train()
    batch = next(iter(datamodule.train_dataloader()))
    with compress_activations(model=module, policy=OffPolicy(), compress_masks=False) as stats:
        logits, targets = module.logits_and_targets(batch, "train")
        F.cross_entropy(logits, targets).backward()
    return stats.saved_bytes


def _describe(cfg: DictConfig) -> str:
    c = cfg.compression
    if c is None:
        return "none (plain)"
    if c.policy == "acgc":
        return f"acgc (e={c.gradient_error:g})"
    if c.policy == "gact":
        return f"gact ({c.bits:g} bits avg)"
    if c.policy == "fixed":
        setting = f"{c.bits} bits" if c.bits is not None else f"eb={c.error_bound}"
        return f"fixed ({c.codec}, {setting})"
    return str(c.policy)


def compose_runs(compressed: str, overrides: Sequence[str] = ()) -> list[DictConfig]:
    """The configs of both runs: ``experiment=compare_digits`` with ``compression=none``
    and with ``compression=<compressed>``, plus ``overrides``."""
    plain = compose_config([f"experiment={EXPERIMENT}", "compression=none", *overrides])
    # the per-site table is left out: the comparison is the output here
    packed = [f"compression={compressed}", "compression.print_table=false"]
    return [plain, compose_config([f"experiment={EXPERIMENT}", *packed, *overrides])]


def compare(cfgs: Sequence[DictConfig]) -> list[dict[str, Any]]:
    """Train each config in turn (see :func:`compose_runs`).

    Returns:
        Per run: ``name``, ``val_acc``, ``saved_mb``, ``kept_mb``, ``ratio``,
        ``seconds`` and all final ``metrics``.
    """
    measured_mb = saved_activation_bytes(cfgs[0]) / 2**20
    # the CPU kernels' one-time build (a few seconds on a fresh machine) before the timed
    # fits: it counted in the first compressed run's time, 8 s against plain's 3 s
    cpu_library()
    rows = []
    for cfg in cfgs:
        metrics = train(cfg)
        if cfg.compression is None:
            saved_mb, ratio = measured_mb, 1.0
        else:
            saved_mb, ratio = metrics.get(SAVED_KEY, measured_mb), metrics.get(RATIO_KEY, 1.0)
        rows.append(
            {
                "name": _describe(cfg),
                "val_acc": metrics.get("val/acc", float("nan")),
                "saved_mb": saved_mb,
                "kept_mb": metrics.get(PACKED_KEY, saved_mb / ratio),
                "ratio": ratio,
                "seconds": metrics["fit_seconds"],
                "metrics": metrics,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]], batch_size: int) -> str:
    """The side-by-side table that :func:`main` prints."""
    head = (
        f"{'run':<26} {'val acc':>8} {'saved MB/step':>14} {'kept MB/step':>13} "
        f"{'ratio':>7} {'time':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['name']:<26} {r['val_acc']:>8.4f} {r['saved_mb']:>14.2f} {r['kept_mb']:>13.2f} "
            f"{r['ratio']:>6.2f}x {r['seconds']:>6.0f}s"
        )
    lines.append(
        f"(activations autograd saves in one training step of {batch_size} images, and what "
        f"is kept of them: plain, measured by the engine's meter; compressed, "
        f"{SAVED_KEY} and {PACKED_KEY} of the last step)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Command line: ``python -m recipes.compare [--compression NAME] [overrides...]``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--compression",
        default=DEFAULT_POLICY,
        help=f"compression config of the second run (default: {DEFAULT_POLICY})",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args(argv)
    try:
        from lightning_acgc import ActivationCompression  # noqa: F401
    except ImportError:
        sys.exit(
            "compare: this install of lightning_acgc has no Lightning callback "
            "(lightning_acgc.ActivationCompression) yet, so there is nothing to compare with; "
            "python recipes/train.py experiment=compare_digits trains the plain side"
        )
    compressed, note = args.compression, ""
    if compressed == DEFAULT_POLICY and DEFAULT_POLICY not in available_policies():
        compressed = FALLBACK_POLICY
        note = (
            f"note: the {DEFAULT_POLICY!r} policy is not available in this install "
            f"(available: {', '.join(available_policies())}); comparing with "
            f"compression={FALLBACK_POLICY} instead\n"
        )
        print(note, end="", flush=True)
    cfgs = compose_runs(compressed, args.overrides)
    rows = compare(cfgs)
    cfg = cfgs[0]
    device = "cuda" if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
    print(
        f"\n{note}compare: ResNet-{cfg.model.depth} (width {cfg.model.width:g}) on digits, "
        f"{cfg.trainer.max_epochs} epochs, batch {cfg.data.batch_size}, seed {cfg.seed} "
        f"({device})\n{format_table(rows, cfg.data.batch_size)}"
    )
    return rows


if __name__ == "__main__":
    main()
