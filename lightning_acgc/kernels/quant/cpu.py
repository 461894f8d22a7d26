"""Compiled CPU path of the ``quant`` codec (``common/csrc/quant.c``), bit-identical to
:mod:`lightning_acgc.kernels.quant.reference` for the same seed.

One pass over each group (``acgc_quant_encode``: its values read once from memory, then
from cache): its min, max and smallest positive value; its parameters with the float32
operations of :func:`~lightning_acgc.kernels.quant.reference.group_meta` (the
specification of the metadata formats, fp32 and bf16); stochastic rounding with the
hashed noise and packing. Tensors holding NaN/inf, or needing float64 arithmetic, go to
the reference.
"""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads
from lightning_acgc.kernels.common.nonfinite import restore_exceptions
from lightning_acgc.kernels.quant.reference import (
    hash_key,
    quant_decode_ref,
    quant_encode_ref,
    without_inf_steps,
)

__all__ = ["quant_decode_cpu", "quant_encode_cpu", "sr_variance_sums_cpu"]


def quant_encode_cpu(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    seed: int,
    meta: str = "fp32",
    reject_inf_steps: bool = False,
) -> dict[str, torch.Tensor] | None:
    """Encode a non-empty CPU floating tensor; same payload as ``quant_encode_ref``.
    ``reject_inf_steps``: None instead of a payload with a step beyond float32 (only the
    reference fallback can write one: the compiled pass keeps every step finite)."""
    lib = cpu_library()
    xf = x.reshape(-1).to(torch.float32).contiguous()
    n = xf.numel()
    groups = -(-n // group_size)
    codes = torch.empty(groups * group_size * bits // 8, dtype=torch.uint8)
    lo, scale = torch.empty(groups, dtype=torch.float32), torch.empty(groups, dtype=torch.float32)
    status = 1
    for bf16 in (True, False) if meta == "bf16" else (False,):
        status = lib.acgc_quant_encode(
            xf.data_ptr(), n, group_size, bits, int(bf16), hash_key(seed), lo.data_ptr(),
            scale.data_ptr(), codes.data_ptr(), cpu_threads(),
        )  # fmt: skip
        if status != 1:  # 1: some group cannot hold bf16 metadata; all groups go to fp32
            break
    if status == 2:  # NaN/inf, or a range or inverse beyond float32: the reference
        payload = quant_encode_ref(x, bits, group_size, seed, meta=meta)
        return without_inf_steps(payload) if reject_inf_steps else payload
    stored = torch.bfloat16 if meta == "bf16" and bf16 else torch.float32
    return {
        "codes": codes,
        "lo": lo.to(stored),
        "scale": scale.to(stored),
        "exc_idx": torch.empty(0, dtype=torch.int64),
        "exc_val": torch.empty(0, dtype=x.dtype),
    }


def quant_decode_cpu(
    payload: dict[str, torch.Tensor],
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode a payload into a flat CPU tensor; same values as ``quant_decode_ref``.
    ``out``: a contiguous flat float32 tensor of ``numel`` values to decode into (float32
    output only; it is returned). C reads the stored lo and scale as ``decode_params``
    does (a payload whose decode needs float64 goes to the reference)."""
    lo, scale, codes = payload["lo"], payload["scale"], payload["codes"]
    groups = lo.numel()
    stored = (torch.float32, torch.bfloat16)
    if (
        lo.dtype not in stored
        or scale.dtype != lo.dtype
        or codes.numel() != groups * group_size * bits // 8
    ):
        return _decode_ref(payload, bits, group_size, numel, dtype, out)
    if not (groups - 1) * group_size < numel <= groups * group_size:
        raise ValueError(f"numel={numel} does not match {groups} groups of {group_size}")
    if out is not None and not (
        out.dtype == dtype == torch.float32 and out.is_contiguous() and out.numel() == numel
    ):
        raise ValueError(f"out must be a contiguous float32 tensor of {numel} values")
    dest = torch.empty(numel, dtype=torch.float32) if out is None else out
    lo, scale, codes = lo.contiguous(), scale.contiguous(), codes.contiguous()
    wide = cpu_library().acgc_quant_unpack(
        codes.data_ptr(), numel, group_size, bits, lo.data_ptr(), scale.data_ptr(),
        int(lo.dtype == torch.bfloat16), dest.data_ptr(), cpu_threads(),
    )  # fmt: skip
    if wide:  # some lo + levels * step beyond float32: the reference's float64 decode
        return _decode_ref(payload, bits, group_size, numel, dtype, out)
    flat = dest if dtype == torch.float32 else dest.to(dtype)
    return restore_exceptions(flat, payload["exc_idx"], payload["exc_val"])


def _decode_ref(
    payload: dict[str, torch.Tensor],
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    out: torch.Tensor | None,
) -> torch.Tensor:
    flat = quant_decode_ref(payload, bits, group_size, numel, dtype)
    return flat if out is None else out.copy_(flat)


def sr_variance_sums_cpu(
    xg: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    min_pos: torch.Tensor,
    zero_kept: torch.Tensor,
) -> torch.Tensor | None:
    """Per width 1..8, the summed stochastic-rounding variance of the groups ``xg`` (rows;
    NaN/inf already zeroed) with their ``lo``, ``hi``, smallest positive value and
    zero-kept flag: the float32 operations of the torch loop in
    :func:`lightning_acgc.policies.quant_error.sr_variance`, one pass for all widths
    (``acgc_sr_variance``; the loop ran 60% of an acgc calibration step). None where it
    does not apply: not float32 on the CPU, empty, or no compiled library."""
    if xg.device.type != "cpu" or xg.dtype != torch.float32 or xg.numel() == 0:
        return None
    lib = cpu_library()
    if lib is None:
        return None
    xg, lo, hi, min_pos = (t.contiguous() for t in (xg, lo, hi, min_pos))
    zk = zero_kept.to(torch.uint8)
    sums = torch.empty(8, dtype=torch.float64)
    lib.acgc_sr_variance(
        xg.data_ptr(), xg.shape[0], xg.shape[1], lo.data_ptr(), hi.data_ptr(),
        min_pos.data_ptr(), zk.data_ptr(), sums.data_ptr(), cpu_threads(),
    )  # fmt: skip
    return sums
