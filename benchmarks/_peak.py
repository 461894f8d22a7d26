"""The process's memory: RSS and its high-water mark (Linux ``/proc``), and a sampled
timeline of one step (RSS on CPU, ``torch.cuda.memory_allocated`` on a GPU)."""

from __future__ import annotations

import ctypes
import resource
import sys
import threading
import time

import torch

__all__ = [
    "Timeline",
    "limit_malloc",
    "maxrss_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
    "rss_bytes",
]

MB = 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    if kb is not None:
        return 1024 * kb
    return maxrss_bytes()  # no /proc: the best there is


def maxrss_bytes() -> int:
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else 1024 * value


def reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark (Linux >= 4.0); False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm = _status_kb("VmHWM")
    return hwm is not None and 1024 * hwm <= rss_bytes() + 1024


def peak_rss_bytes() -> int:
    hwm = _status_kb("VmHWM")
    return 1024 * hwm if hwm is not None else maxrss_bytes()


class Timeline:
    """Samples the process's memory every millisecond in a thread while it is entered:
    RSS on CPU (``/proc/self/statm``), ``torch.cuda.memory_allocated`` on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._page = resource.getpagesize()

    def _read(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:
            return rss_bytes()

    def _run(self) -> None:
        start = time.perf_counter()
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - start, self._read()))
            time.sleep(0.001)

    def __enter__(self) -> Timeline:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def points(self, base: int, n: int = 120) -> list[list[float]]:
        """At most ``n`` [ms, MB above ``base``] points, each the peak of its time slice."""
        if not self.samples:
            return []
        end = self.samples[-1][0] or 1.0
        buckets: dict[int, tuple[float, int]] = {}
        for s, value in self.samples:
            i = min(n - 1, int(n * s / end))
            if i not in buckets or value > buckets[i][1]:
                buckets[i] = (s, value)
        return [[round(1e3 * s, 2), round((v - base) / MB, 2)] for s, v in buckets.values()]


def limit_malloc() -> None:
    """glibc: return freed blocks above 128 KiB to the system at once (no dynamic mmap
    threshold), so that the RSS before a step is not inflated by the warm-up step's
    freed memory. Elsewhere nothing is changed."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
