"""Where a benchmark runs: the device, the machine's description, threads, the command
line options every benchmark shares, its JSON line and its progress bar."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

__all__ = [
    "add_common_arguments",
    "commit",
    "emit",
    "machine",
    "progress",
    "resolve_device",
    "setup_threads",
    "synchronize",
]


def resolve_device(name: str) -> torch.device:
    """``"auto"``: CUDA when available, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict[str, Any]:
    """Where a benchmark ran: platform, CPU, core count, torch, threads, device, date."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if hasattr(os, "getloadavg"):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)  # other work on the machine
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def progress(items: Iterable[Any], desc: str, total: int | None = None) -> Iterator[Any]:
    """``items`` with a progress bar on stderr (tqdm; updated at most once a second)."""
    return iter(tqdm(items, desc=desc, total=total, file=sys.stderr, mininterval=1.0))


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes (2 CPU cores)")
    parser.add_argument("--full", action="store_true", help="full sizes (the default)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads; default: 1 with --quick, else torch's default",
    )


def setup_threads(args: argparse.Namespace) -> None:
    """Set torch's thread count (``args.threads`` is filled in with what was used).

    ``--quick`` defaults to one thread: on a small machine shared with other work,
    OpenMP threads that wait at barriers for a busy core made a 2-thread step of the
    quick ResNet 50x slower than a 1-thread one (measured: 4.3 s vs 0.09 s).
    """
    if args.threads is None and args.quick:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()


def commit() -> str:
    """The repository's commit (``+dirty`` with uncommitted changes outside
    ``benchmarks/results/``; ``unknown`` outside a git checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True
        )
        dirty = subprocess.run(  # the results files run_all writes between benchmarks do not count
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!benchmarks/results",
            ],
            cwd=root,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def emit(result: dict[str, Any]) -> None:
    """Print the benchmark's one JSON line (with the commit it measured)."""
    result.setdefault("commit", commit())
    print(json.dumps(result), flush=True)
