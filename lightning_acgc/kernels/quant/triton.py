"""Triton kernels of the ``quant`` codec: fused encode and decode, same format as the
torch reference in :mod:`lightning_acgc.kernels.quant.reference` (read its docstring for
the format).

Encode is one pass over the data: each program loads a ``[GROUPS_PER_PROG, group]`` block,
reduces min/max (and the smallest positive value for zero-kept groups), draws Philox noise
(``tl.rand4x``; the reference hashes (seed, index) instead) or reads injected noise,
rounds, packs the codes to bytes and writes them with ``lo``/``scale``. Decode unpacks and
writes straight into the output dtype.

Exactness against the reference:

* With injected ``noise`` the payload is bit-identical to ``quant_encode_ref(..., noise)``
  (same float32 operations in the same order: IEEE division ``div_rn``, ``mul.rn`` so that
  the compiler cannot fuse ``t * inv + u`` into an FMA).
* Without it the codes come from Triton's Philox stream, not the reference's hash: valid
  codes of the same distribution (unbiased, within one step), not the same bytes.
* Decode equals ``quant_decode_ref`` bit for bit, including its float64 path: the
  reference computes ``lo + q * step`` with ``addcmul``, which torch evaluates as one FMA;
  the kernel calls ``tl.fma``.

Rare cases: tensors holding NaN/inf get their exception list and filled groups from the
reference's own torch helper (then the kernel runs on the filled groups); tensors with a
group range beyond float32 or a subnormal step (whose inverse overflows) are encoded by
the reference itself (it switches that whole tensor to float64).
"""

from __future__ import annotations

import torch
import triton
from torch.library import wrap_triton

from lightning_acgc.kernels.common.groups import group_view
from lightning_acgc.kernels.common.nonfinite import fill_nonfinite_rows, restore_exceptions
from lightning_acgc.kernels.common.triton_utils import (
    LAUNCH_OPTIONS,
    block_elems,
    check_contiguous,
    check_device,
    check_dtype,
    eager_or_op,
    interpreting,
    launchable,
    next_power_of_2,
    philox_seed,
    rows_per_program,
)
from lightning_acgc.kernels.quant.reference import quant_encode_ref, without_inf_steps
from lightning_acgc.kernels.quant.triton_jit import (
    _FLOAT64,
    _NONFINITE,
    _quant_decode_kernel,
    _quant_encode_kernel,
    _quant_wide_kernel,
)

__all__ = ["quant_decode_triton", "quant_encode_triton", "quant_encode_triton_unchecked"]

_IN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_ALLOWED_BITS = tuple(range(1, 9))  # the codec's widths (users pick 1, 2, 4 or 8)


def _check_config(bits: int, group_size: int) -> None:
    if isinstance(bits, bool) or bits not in _ALLOWED_BITS:
        raise ValueError(f"bits={bits!r} is not allowed; allowed values: {list(_ALLOWED_BITS)}")
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size <= 0
        or group_size % 8
    ):
        raise ValueError(f"group_size={group_size!r} must be a positive multiple of 8")


@eager_or_op("lightning_acgc::quant_encode_core")
def _quant_encode_core(
    x: torch.Tensor, noise: torch.Tensor | None, bits: int, group_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch of the encode kernel: ``(codes, lo, scale, status)``; the caller
    checked the arguments. A ``torch.library`` op so that ``torch.compile`` can trace it."""
    numel = x.numel()
    n_groups = triton.cdiv(numel, group_size)
    group_p2 = next_power_of_2(group_size)
    gpp = rows_per_program(group_p2, n_groups)
    codes = torch.empty(n_groups * group_size * bits // 8, dtype=torch.uint8, device=x.device)
    lo = torch.empty(n_groups, dtype=torch.float32, device=x.device)
    scale = torch.empty_like(lo)
    status = torch.zeros(1, dtype=torch.int32, device=x.device)
    wrap_triton(_quant_encode_kernel)[(triton.cdiv(n_groups, gpp),)](
        x,
        noise if noise is not None else lo,
        codes,
        lo,
        scale,
        status,
        numel,
        n_groups,
        seed,
        GROUP=group_size,
        GROUP_P2=group_p2,
        BITS=bits,
        GPP=gpp,
        USE_NOISE=noise is not None,
        IDX64=(n_groups + gpp) * group_p2 >= 2**31,
        INTERPRET=interpreting(),
        **LAUNCH_OPTIONS,
    )
    return codes, lo, scale, status


@eager_or_op("lightning_acgc::quant_decode_core")
def _quant_decode_core(
    codes: torch.Tensor,
    lo: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One launch of the decode kernel (no exceptions restored); the caller checked the
    arguments. A ``torch.library`` op so that ``torch.compile`` can trace it."""
    out = torch.empty(numel, dtype=dtype, device=lo.device)
    _decode_into(codes, lo, scale, bits, group_size, out)
    return out


def _decode_into(
    codes: torch.Tensor,
    lo: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    group_size: int,
    out: torch.Tensor,
) -> None:
    """Launch the decode into the flat contiguous ``out`` (its dtype one of
    ``_OUT_DTYPES``): two small launches and the decode itself, no host sync."""
    n_groups, numel, dtype = lo.numel(), out.numel(), out.dtype
    # The reference decodes the whole tensor in float64 when any lo + levels * step
    # overflows float32; this flag stays on the device.
    use_f64 = torch.zeros(1, dtype=torch.int32, device=lo.device)
    block = min(block_elems(), next_power_of_2(n_groups))
    launchable(_quant_wide_kernel)[(triton.cdiv(n_groups, block),)](
        lo, scale, use_f64, n_groups,
        LEVELS=2**bits - 1, BLOCK=block, INTERPRET=interpreting(), **LAUNCH_OPTIONS,
    )  # fmt: skip
    group_p2 = next_power_of_2(group_size)
    gpp = rows_per_program(group_p2, n_groups)
    launchable(_quant_decode_kernel)[(triton.cdiv(n_groups, gpp),)](
        codes,
        lo,
        scale,
        use_f64,
        out.view(torch.int16) if dtype == torch.bfloat16 else out,
        numel,
        n_groups,
        GROUP=group_size,
        GROUP_P2=group_p2,
        BITS=bits,
        GPP=gpp,
        IDX64=(n_groups + gpp) * group_p2 >= 2**31,
        OUT_KIND=_OUT_DTYPES.index(dtype),
        **LAUNCH_OPTIONS,
    )


def _check_encode_args(
    x: torch.Tensor, bits: int, group_size: int, noise: torch.Tensor | None
) -> None:
    _check_config(bits, group_size)
    check_device(x, "x")
    check_dtype(x, "x", _IN_DTYPES)
    check_contiguous(x, "x")
    if x.numel() == 0:
        raise ValueError("x is empty; the quant codec keeps empty tensors as they are")
    if noise is not None:
        n_groups = triton.cdiv(x.numel(), group_size)
        check_dtype(noise, "noise", (torch.float32,))
        check_contiguous(noise, "noise")
        if tuple(noise.shape) != (n_groups, group_size) or noise.device != x.device:
            raise ValueError(
                f"noise must have shape {(n_groups, group_size)} on {x.device}, got "
                f"{tuple(noise.shape)} on {noise.device}"
            )


def quant_encode_triton_unchecked(
    x: torch.Tensor, bits: int, group_size: int, seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """:func:`quant_encode_triton` without its host sync: ``(payload, status)``, where
    the payload is the one :func:`quant_encode_triton` returns if the device's
    ``status`` (int32, one element) is 0; else (NaN/inf inside, or a range needing
    float64) encode ``x`` again with :func:`quant_encode_triton`. Arguments and errors as
    there (no injected noise).
    """
    _check_encode_args(x, bits, group_size, None)
    return _encode_launch(x, None, bits, group_size, philox_seed(seed))


def _encode_launch(
    x: torch.Tensor, noise: torch.Tensor | None, bits: int, group_size: int, seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The kernel's payload (no exceptions) and its status, without reading it."""
    codes, lo, scale, status = _quant_encode_core(x, noise, bits, group_size, seed)
    payload = {
        "codes": codes,
        "lo": lo,
        "scale": scale,
        "exc_idx": torch.empty(0, dtype=torch.int64, device=x.device),
        "exc_val": torch.empty(0, dtype=x.dtype, device=x.device),
    }
    return payload, status


def quant_encode_triton(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    seed: int,
    noise: torch.Tensor | None = None,
    reject_inf_steps: bool = False,
) -> dict[str, torch.Tensor] | None:
    """Encode ``x`` in the format of
    :func:`~lightning_acgc.kernels.quant.reference.quant_encode_ref`.

    Args:
        x: non-empty contiguous float32/float16/bfloat16 tensor on a CUDA device (or any
            device under ``TRITON_INTERPRET=1``).
        bits: bits per code, 1 to 8.
        group_size: values per group, a positive multiple of 8.
        seed: Philox seed of the stochastic rounding.
        noise: optional float32 ``(G, group_size)`` U[0, 1) noise used instead of the
            Philox draw; with it the payload equals ``quant_encode_ref(..., noise=noise)``.
        reject_inf_steps: return ``None`` instead of a payload with a step beyond
            float32 (stored as inf). Only the rare float64 fallback can write one, so this
            costs no extra host sync.

    Returns:
        The payload dict: ``codes``, ``lo``, ``scale``, ``exc_idx``, ``exc_val``.

    Raises:
        RuntimeError: Triton cannot run on ``x``'s device.
        TypeError: ``x`` or ``noise`` has an unsupported dtype.
        ValueError: bad ``bits``/``group_size``, empty or non-contiguous ``x``, or
            ``noise`` of the wrong shape or device.
    """
    _check_encode_args(x, bits, group_size, noise)
    seed = philox_seed(seed)
    payload, status = _encode_launch(x, noise, bits, group_size, seed)
    worst = int(status)  # the one host sync: the payload's shape depends on it
    if worst == _NONFINITE:
        # Exceptions and fill values exactly as the reference computes them; then the
        # kernel quantizes the filled (already padded) groups.
        xg, exc_idx, exc_val = fill_nonfinite_rows(group_view(x, group_size))
        keep = exc_idx < x.numel()  # padding copies of a non-finite last value
        payload, status = _encode_launch(xg.reshape(-1), noise, bits, group_size, seed)
        payload["exc_idx"], payload["exc_val"] = exc_idx[keep], exc_val[keep].to(x.dtype)
        worst = int(status)
    if worst == _FLOAT64:
        # A group's range exceeds float32, or its step is subnormal (1 / step overflows):
        # the reference switches the whole tensor to float64, so let it encode this (rare)
        # tensor. Its codes then come from torch's generator unless noise was injected.
        payload = quant_encode_ref(x, bits, group_size, seed, noise=noise)
        return without_inf_steps(payload) if reject_inf_steps else payload
    return payload


def quant_decode_triton(
    payload: dict[str, torch.Tensor],
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode a ``quant`` payload (from either path) into a flat tensor of ``numel`` values.

    Args:
        payload: ``codes``, ``lo``, ``scale``, ``exc_idx``, ``exc_val`` as the encoders write.
        bits: bits per code, 1 to 8.
        group_size: values per group, a positive multiple of 8.
        numel: values to decode (the original tensor's ``numel``).
        dtype: output dtype (float32, float16, bfloat16 or float64).
        out: a contiguous flat tensor of ``numel`` values in ``dtype`` on the payload's
            device, written in place and returned (no new tensor, no copy).

    Returns:
        A flat tensor equal to ``quant_decode_ref`` with the same arguments (``out`` if
        given, else a new one).

    Raises:
        RuntimeError: Triton cannot run on the payload's device.
        TypeError: a payload tensor or ``dtype`` is not supported.
        ValueError: bad ``bits``/``group_size``, or sizes that do not fit together.
    """
    _check_config(bits, group_size)
    codes, lo, scale = payload["codes"], payload["lo"], payload["scale"]
    check_device(lo, "payload['lo']")
    check_dtype(codes, "payload['codes']", (torch.uint8,))
    check_dtype(lo, "payload['lo']", (torch.float32,))
    check_dtype(scale, "payload['scale']", (torch.float32,))
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"dtype={dtype} is not supported; allowed: {[str(d) for d in _OUT_DTYPES]}")
    for name, t in (("codes", codes), ("lo", lo), ("scale", scale)):
        check_contiguous(t, f"payload['{name}']")
        if t.device != lo.device:
            raise ValueError(f"payload['{name}'] is on {t.device}, payload['lo'] on {lo.device}")
    n_groups = lo.numel()
    if scale.numel() != n_groups or codes.numel() != n_groups * group_size * bits // 8:
        raise ValueError(
            f"payload sizes do not fit: {n_groups} groups of {group_size} at {bits} bits need "
            f"{n_groups} scales and {n_groups * group_size * bits // 8} code bytes, got "
            f"{scale.numel()} and {codes.numel()}"
        )
    if not (n_groups - 1) * group_size < numel <= n_groups * group_size:
        raise ValueError(f"numel={numel} does not match {n_groups} groups of {group_size}")
    if out is None:
        out = _quant_decode_core(codes, lo, scale, bits, group_size, numel, dtype)
    else:
        if out.dtype != dtype or out.shape != (numel,) or out.device != lo.device:
            raise ValueError(
                f"out must be a flat {dtype} tensor of {numel} values on {lo.device}, got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}"
            )
        check_contiguous(out, "out")
        if torch.compiler.is_compiling():  # the traced op allocates its own output
            out.copy_(_quant_decode_core(codes, lo, scale, bits, group_size, numel, dtype))
        else:
            _decode_into(codes, lo, scale, bits, group_size, out)
    return restore_exceptions(out, payload["exc_idx"], payload["exc_val"])
