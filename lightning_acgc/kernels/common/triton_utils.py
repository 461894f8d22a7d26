"""Helpers shared by the Triton launchers: argument checks, block sizing, seeded noise.

Only the ``triton`` modules of the kernel families import this file, so importing it
may import triton.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from lightning_acgc.kernels.common.dispatch import triton_available

__all__ = [
    "LAUNCH_OPTIONS",
    "block_elems",
    "check_contiguous",
    "check_device",
    "check_dtype",
    "compile_for_cuda",
    "eager_or_op",
    "interpreting",
    "launchable",
    "mul_rn",
    "next_power_of_2",
    "philox_seed",
    "rows_per_program",
    "store_narrow",
    "uniform_rows",
]

try:  # torch's own switch (what a triton_op's eager call sets): launch without the HOP
    from torch._library.triton import set_wrap_triton_enabled as _wrap_triton_enabled
except ImportError:  # pragma: no cover - older or newer torch without the switch

    def _wrap_triton_enabled(enabled: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


# Launch options of every kernel here (only names torch.compile's Triton wrapper knows).
LAUNCH_OPTIONS: dict[str, int] = {"num_warps": 8}

# Elements one program handles. On a GPU 2K elements over 8 warps keep the encode kernels
# near 100 registers per thread (sm_90 compile: 84-122) for occupancy; under the
# interpreter every tl op is one numpy call per program, so fewer, larger programs win.
_BLOCK_ELEMS_GPU = 2048
_BLOCK_ELEMS_INTERPRETER = 1 << 15


def eager_or_op(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a launcher as ``torch.library.triton_op(name)`` for ``torch.compile`` and
    call it directly otherwise.

    The op lets Dynamo trace a launch into Triton kernel nodes; called eagerly, its
    dispatch costs about 0.3 ms of host time a call (H100 machine, torch 2.11), more than
    the kernel takes for most activations, so eager calls skip it. An eager call also
    turns off ``wrap_triton``'s higher-order-op dispatch for its launches, as torch's
    ``triton_op`` does on its own eager path: left on, each ``wrap_triton(kernel)[grid]``
    launch costs about 0.85 ms of host time (H200 machine, torch 2.11: a compressed
    ResNet-18 step spent 60% of its host time there) against about 0.08 ms for the
    plain Triton launch. The op stays reachable as the wrapper's ``op`` attribute.
    """

    def wrap(launcher: Callable[..., Any]) -> Callable[..., Any]:
        op = triton_op(name, mutates_args=())(launcher)

        @functools.wraps(launcher)
        def call(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            with _wrap_triton_enabled(False):
                return launcher(*args, **kwargs)

        call.op = op  # type: ignore[attr-defined]
        return call

    return wrap


def launchable(kernel: Any) -> Any:
    """``kernel`` ready for ``[grid](...)`` outside an :func:`eager_or_op` launcher:
    ``wrap_triton(kernel)`` while ``torch.compile`` traces, the kernel itself otherwise
    (see :func:`eager_or_op` for what the wrapper costs eagerly)."""
    return wrap_triton(kernel) if torch.compiler.is_compiling() else kernel


def interpreting() -> bool:
    """Whether Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return int(triton.next_power_of_2(max(int(n), 1)))


def block_elems() -> int:
    """Target elements per program (see ``_BLOCK_ELEMS_GPU``)."""
    return _BLOCK_ELEMS_INTERPRETER if interpreting() else _BLOCK_ELEMS_GPU


def rows_per_program(row_len_p2: int, n_rows: int) -> int:
    """Rows (groups) per program for a 2-D block ``[rows, row_len_p2]``: a power of two,
    no larger than needed for ``n_rows``."""
    rows = max(1, block_elems() // row_len_p2)
    return min(rows, next_power_of_2(n_rows))


def check_device(t: torch.Tensor, name: str) -> None:
    """Raise unless Triton can run on ``t``'s device.

    Raises:
        RuntimeError: ``t`` is not on a CUDA device and ``TRITON_INTERPRET=1`` is not set.
    """
    if not triton_available(t.device):
        raise RuntimeError(
            f"{name} is on {t.device}; the Triton kernels need a CUDA tensor, or "
            "TRITON_INTERPRET=1 set before triton is imported (CPU testing). Use the "
            "torch reference (backend='torch') for CPU tensors."
        )


def check_contiguous(t: torch.Tensor, name: str) -> None:
    """Raise unless ``t`` is contiguous.

    Raises:
        ValueError: ``t`` is not contiguous.
    """
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
            "call .contiguous() first"
        )


def check_dtype(t: torch.Tensor, name: str, allowed: tuple[torch.dtype, ...]) -> None:
    """Raise unless ``t.dtype`` is one of ``allowed``.

    Raises:
        TypeError: the dtype is not allowed.
    """
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: {[str(d) for d in allowed]}")


def compile_for_cuda(
    fn: object, signature: dict[str, str], constexprs: dict[str, object], capability: int = 90
) -> object:
    """Compile a ``@triton.jit`` kernel for an NVIDIA GPU of compute ``capability`` without
    one (Triton ships ``ptxas``): catches what the interpreter cannot see (types that
    differ between the branches of a runtime ``if``, unsupported ops). Needs a process in
    which triton was imported without ``TRITON_INTERPRET=1``.

    Args:
        fn: the kernel.
        signature: runtime argument name -> Triton type (``"*fp32"``, ``"i32"``, ...).
        constexprs: ``tl.constexpr`` argument name -> value.
        capability: e.g. 90 for H100.

    Returns:
        The compiled kernel (``.asm`` holds ``ttir``, ``ptx``, ``cubin``).

    Raises:
        RuntimeError: running under the interpreter.
    """
    if interpreting():
        raise RuntimeError("compile_for_cuda needs TRITON_INTERPRET unset when triton loads")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(fn=fn, signature=full, constexprs=dict(constexprs))
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=LAUNCH_OPTIONS)


def philox_seed(seed: int) -> int:
    """The seed as the kernels take it: non-negative, below 2**63 (as the reference)."""
    return int(seed) & 0x7FFF_FFFF_FFFF_FFFF


@triton.jit
def uniform_rows(seed, rows, ROW: tl.constexpr, ROW_P2: tl.constexpr):
    """U[0, 1) noise for the block ``[len(rows), ROW_P2]`` of a row-major (n, ROW) array.

    Element ``i = row * ROW + col`` gets output ``i % 4`` of Philox4x32 at counter
    ``i // 4`` (``ROW`` a multiple of 4): one Philox evaluation per four elements, and the
    value of an element depends only on ``seed`` and ``i``, never on the block shape.
    """
    QUADS: tl.constexpr = ROW_P2 // 4
    counter = rows[:, None] * (ROW // 4) + tl.arange(0, QUADS)[None, :]
    u0, u1, u2, u3 = tl.rand4x(seed, counter)
    # join(join(u0, u2), join(u1, u3))[..., a, b] == u_{2a+b}: row-major flattening of the
    # trailing (2, 2) puts u_r at offset r.
    quad = tl.join(tl.join(u0, u2), tl.join(u1, u3))
    return tl.reshape(quad, (rows.shape[0], ROW_P2))


@triton.jit
def mul_rn(a, b, INTERPRET: tl.constexpr):
    """float32 ``a * b`` rounded on its own: never contracted with a following add into an
    FMA, subnormals kept.

    The torch reference rounds products and sums separately, but a GPU compiler may fuse
    ``a * b + c`` into one FMA (one rounding). PTX ``mul.rn.f32`` (explicit rounding, no
    ``.ftz``) is exempt from that. The interpreter (numpy, ``INTERPRET``) never fuses.
    """
    if INTERPRET:
        out = a * b
    else:
        out = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;",
            "=r,r,r",
            [a.to(tl.float32), b.to(tl.float32)],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    return out


@triton.jit
def store_narrow(v, OUT_KIND: tl.constexpr):
    """``v`` (float32; float64 allowed for kind 3) as stored for ``OUT_KIND``: 0 float32,
    1 float16, 2 bfloat16 as its int16 bits (store through an int16 view), 3 float64."""
    if OUT_KIND == 0:
        out = v.to(tl.float32)
    elif OUT_KIND == 1:
        out = v.to(tl.float16)
    elif OUT_KIND == 2:
        # Round to nearest even by hand (torch's rule for finite values and inf): the
        # interpreter's float32 -> bfloat16 cast truncates, a GPU's rounds; this is exact on
        # both.
        b = v.to(tl.float32).to(tl.int32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        out = (b >> 16).to(tl.int16)
    else:
        out = v.to(tl.float64)
    return out
