"""Hugging Face causal language models, side by side: plain training,
``torch.utils.checkpoint`` per decoder layer, acgc at its default, gact and fixed 2- and
4-bit quantization, on GPT-2 small's and SmolLM-135M's (Llama) dimensions.

Prints one JSON line with, per model, the memory benchmark's measurements (``memory``:
activations saved and kept, ratio, gradient error of one ordinary step against the exact
gradient of the same batch, the step's whole-process peak in a child process) and the
speed benchmark's (``speed``: forward + backward time over interleaved rounds, median
ratio to plain, calibration steps); see ``benchmarks/memory.py`` and
``benchmarks/speed.py`` for how each is measured. The models train on Python's
documentation text (the char-LM recipe's data; ``recipes/models/causal_lm.py``), with
Hugging Face's default fused attention (``sdpa``) and no key/value cache.

    python -m benchmarks.causal_lm [--quick] [--models gpt2_small] [--rounds 5]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import memory, speed
from benchmarks._cases import LM_CASES, cases_parser, pick_cases
from benchmarks._harness import POLICIES, emit, machine, resolve_device, setup_threads

# What a user chooses between: nothing, checkpointing, acgc, the fixed settings and gact
CONFIGS = ("plain", "checkpoint", "acgc", "gact", "quant2", "quant4")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cases_parser(__doc__, "_cases.LM_CASES")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--rounds", type=int, default=None, help="default: 5 quick, 3 full")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the case's")
    parser.add_argument("--no-peak", action="store_true", help="skip the child processes")
    args = parser.parse_args(argv)
    setup_threads(args)
    mode = "quick" if args.quick else "full"
    if args.rounds is None:
        args.rounds = 5 if args.quick else 3
    if "plain" not in args.configs:
        args.configs = ["plain", *args.configs]
    args.models = pick_cases(parser, args.models, mode, LM_CASES)
    device = resolve_device(args.device)
    print(
        f"causal_lm ({mode}): {args.models}, batch {args.batch_size or 'of each case'}, "
        f"{args.rounds} rounds, {args.threads} thread(s), {device}; {args.configs}",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory() as tmp:
        measured = {name: memory.measure_model(args, name, Path(tmp)) for name in args.models}
    timed = {name: speed.measure_model(args, name) for name in args.models}
    result = {
        "benchmark": "causal_lm",
        "mode": mode,
        "machine": machine(device),
        "threads": args.threads,
        "rounds": args.rounds,
        "policies": {k: {"policy": p, **o} for k, (p, o) in POLICIES.items()},
        "memory": {"models": measured},
        "speed": {"models": timed},
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
