"""Build (once, with the machine's C compiler) and load the compiled CPU kernels.

The C sources in ``csrc/`` (one file per codec, their shared helpers in ``fastcpu.h``)
need no torch headers: the kernels receive data pointers (``tensor.data_ptr()``) through
ctypes. On first use they are compiled with ``cc -O3 -fopenmp`` into one library in a
cache folder (``$LIGHTNING_ACGC_CACHE``, else ``$XDG_CACHE_HOME/lightning_acgc``, else
``~/.cache/lightning_acgc``), keyed by a hash of the sources, the flags and the CPU, which
prints one line. Without a compiler (or with
``LIGHTNING_ACGC_CPU_LIB=0``) the codecs use their pure-torch references, and one line
says so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["cpu_library", "cpu_threads"]

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = sorted(_CSRC.glob("*.c"))  # the header is in the cache key too (_source_bytes)
# -ffp-contract=off: no FMA contraction (bit-identical to torch's separate operations);
# -fno-trapping-math: the same values, but selects and divisions in loops vectorize (with
# trapping math GCC keeps every conditional element scalar: bounded encode 18 ns/value).
_FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-lm",
]

_I64, _I32, _U32, _P = ctypes.c_int64, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p
_U64 = ctypes.c_uint64
_F32, _F64 = ctypes.c_float, ctypes.c_double
_VIEW = [_I64, _I64, _I64, _I64, _I32, _I32]  # division's (planes, h, w, block, pool h, pool w)
_SIGNATURES = {
    "acgc_quant_encode": (_I32, [_P, _I64, _I64, _I32, _I32, _U32, _P, _P, _P, _I32]),
    "acgc_quant_unpack": (_I32, [_P, _I64, _I64, _I32, _P, _P, _I32, _P, _I32]),
    "acgc_quant_noise": (None, [_U64, _I64, _U32, _P]),
    "acgc_mask_pack": (None, [_P, _I64, _P, _I32]),
    "acgc_mask_unpack": (None, [_P, _I64, _P, _I32]),
    "acgc_mask_positive_f32": (None, [_P, _I64, _P, _I32]),
    "acgc_mask_two_f32": (_I64, [_P, _I64, _F32, _F32, _P, _I32]),
    "acgc_mask_select_f32": (None, [_P, _I64, _F32, _F32, _P, _I32]),
    "acgc_mask_affine_f32": (None, [_P, _I64, _I64, _I64, _P, _P, _P, _P, _F32, _P, _I32]),
    "acgc_has_f16": (_I32, []),
    "acgc_bounded_pack": (
        _I64,
        [_P, _I64, _I64, _P, _P, _P, _P, _F64, _F32, _I32, _I32, _P, _P, _I32],
    ),
    "acgc_pool_last": (None, [_P, _I64, _I64, _I64, _P, _I32]),
    "acgc_zero_pattern": (None, [_P, _I64, _P, _P, _I32]),
    "acgc_division_finish": (None, [_P, _I64, _F32, _P, _F32, _I32]),
    "acgc_division_low": (_I32, [_P, *_VIEW, _I32, _P, _P, _I32]),
    "acgc_division_residual": (
        _I32,
        [_P, *_VIEW, _P, _I32, _I64, _U32, _P, _P, _P, _P, _P, _I32],
    ),
    "acgc_division_decode": (
        _I32,
        [_P, *_VIEW, _P, _I32, _I64, _P, _P, _F32, _P, _F32, _P, _I32],
    ),
    "acgc_intpack_base": (ctypes.c_uint64, [_P, _I64, _I64, _P, _I32]),
    "acgc_intpack_pack": (None, [_P, _I64, _I64, _P, _I32, _P, _I32]),
    "acgc_intpack_unpack": (None, [_P, _I64, _I64, _P, _I32, _P, _I32]),
    "acgc_window_pack": (
        _I32,
        [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I32, _I32, _P, _P, _I32],
    ),
    "acgc_window_unpack": (
        None,
        [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I32, _I32, _P, _I32],
    ),
    "acgc_bounded_stats": (_I32, [_P, _I64, _I64, _P, _P, _P, _P, _P, _I32]),
    "acgc_bounded_offsets": (_I64, [_P, _I64, _I64, _P]),
    "acgc_bounded_plan": (
        _I32,
        [_P, _P, _P, _P, _I64, _F64, _I32, _F64, _F64, _F64, _P, _P, _P, _I32],
    ),
    "acgc_bounded_unpack": (None, [_P, _I64, _I64, _P, _P, _P, _P, _F32, _I32, _P, _I32]),
    "acgc_channel_normalize": (None, [_P, _I64, _I64, _I64, _F32, _P, _P, _P, _P, _P, _P, _I32]),
    "acgc_sr_variance": (None, [_P, _I64, _I64, _P, _P, _P, _P, _P, _I32]),
    "acgc_squared_sum_f32": (_F64, [_P, _P, _I64, _I32]),
    "acgc_nonzero_split": (_I64, [_P, _I64, _I32, _P, _P, _I32]),
    "acgc_nonzero_merge": (_I64, [_P, _P, _I64, _I64, _I32, _P, _I32]),
}


def _cache_dir() -> Path:
    if os.environ.get("LIGHTNING_ACGC_CACHE"):
        return Path(os.environ["LIGHTNING_ACGC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_acgc"


def _cpu_id() -> bytes:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    return next((ln for ln in lines if ln.startswith("flags")), "").encode()


def _source_bytes() -> bytes:
    """Every C source and header, each after its name (a renamed file changes the key)."""
    files = sorted(p for p in _CSRC.iterdir() if p.suffix in (".c", ".h"))
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in files)


def _notice(msg: str) -> None:
    print(f"lightning_acgc: {msg}", file=sys.stderr)


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(out)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(out, target)  # atomic: concurrent builders never see half a file


@functools.lru_cache(maxsize=1)
def cpu_library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (after a one-line notice) where no
    compiler is there, the build fails, or ``LIGHTNING_ACGC_CPU_LIB=0``.

    Example:
        >>> lib = cpu_library()
        >>> lib is None or hasattr(lib, "acgc_quant_encode")
        True
    """
    if os.environ.get("LIGHTNING_ACGC_CPU_LIB") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    fallback = "CPU codecs use the slower pure-torch reference"
    if compiler is None:
        _notice(f"no C compiler (cc/gcc) found; {fallback}")
        return None
    key = hashlib.sha256(_source_bytes() + " ".join(_FLAGS).encode() + _cpu_id())
    target = _cache_dir() / f"fastcpu-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _notice(f"compiling the CPU codec kernels (once) into {target}")
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or str(err).encode()
        _notice(f"building the CPU kernels failed ({detail.decode()[:200]!r}); {fallback}")
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def cpu_threads() -> int:
    """Threads the kernels use: torch's intra-op thread count."""
    import torch

    return torch.get_num_threads()
