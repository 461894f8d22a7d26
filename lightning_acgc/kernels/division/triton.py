"""Triton path of the ``division`` codec, same format as the torch reference in
:mod:`lightning_acgc.kernels.division.reference` (read its docstring for the format).

Kernels:

* ``_pool_kernel``: block average along one axis of a ``(outer, L, inner)`` view, summed
  in float32 in tile order (``0 + x_0 + x_1 + ...``) and divided by the tile's element
  count; the reference's separable passes (last pooled axis first) are repeated one
  launch per axis, so each pass rounds exactly where the reference's does.
* ``_tile_kernel``: the upsampled average applied per element without materializing it:
  ``r = x - up(low)`` (encode), or ``clamp(r_hat + up(low))`` with the zero mask and the
  cast to the output dtype (decode).
* The residual goes through the ``quant`` kernels (:mod:`.quant_triton`), the zero mask
  through the ``mask`` kernels.

Exactness: the residual, the quantization (with injected noise) and the decode are
bit-identical to the reference given the same ``low``. ``low`` is identical when the
reference's float32 tile sums run in tile order; ``torch.sum`` does not promise an order
(on CPU it is sequential for whole tiles of 8 but not for some tails), so a sum may
differ from the reference's in its last bit.

Rare cases go through the reference's own code with the Triton quant and mask kernels:
NaN/inf, magnitudes above float32 max / 2, averages that overflow float32, 0-d tensors,
and tensors of more than 5 dimensions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
from torch.library import wrap_triton

from lightning_acgc.kernels.common.nonfinite import restore_exceptions
from lightning_acgc.kernels.common.triton_utils import (
    LAUNCH_OPTIONS,
    block_elems,
    check_contiguous,
    check_device,
    check_dtype,
    eager_or_op,
    next_power_of_2,
)
from lightning_acgc.kernels.division.reference import (
    Kernels,
    division_decode_with,
    division_encode_with,
    pool_axes,
    zero_pattern,
)
from lightning_acgc.kernels.division.triton_jit import (
    _pool_kernel,
    _tile_kernel,
)
from lightning_acgc.kernels.mask.triton import mask_pack_triton, mask_unpack_triton
from lightning_acgc.kernels.quant.triton import quant_decode_triton, quant_encode_triton

__all__ = ["division_decode_triton", "division_encode_triton", "division_lowpass_triton"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP32_MAX = torch.finfo(torch.float32).max
# The quant and mask kernels the division format is written with on the rare paths.
_TRITON_KERNELS = Kernels(
    quant_encode_triton, quant_decode_triton, mask_pack_triton, mask_unpack_triton
)


def _tile_shape(rows: int, cols: int) -> tuple[int, int]:
    """A power-of-two block ``[rows, cols]`` of about the target number of elements."""
    target = block_elems()
    bc = min(next_power_of_2(cols), target, 1024)
    br = max(1, min(target // bc, next_power_of_2(rows)))
    return br, bc


def _canonical(shape: Sequence[int]) -> tuple[int, int, int, int, bool] | None:
    """``(O, A, B, W, last_pooled)``: the tensor as (O, A, B, W) with A and B pooled (size 1
    where the layout has no such axis) and W the last axis; None where not supported."""
    nd = len(shape)
    if nd in (1, 2):
        return math.prod(shape[:-1]), 1, 1, shape[-1], True
    if nd == 3:  # (N, L, D) pooled over L
        return shape[0], 1, shape[1], shape[2], False
    if nd == 4:
        return shape[0] * shape[1], 1, shape[2], shape[3], True
    if nd == 5:
        return shape[0] * shape[1], shape[2], shape[3], shape[4], True
    return None


@eager_or_op("lightning_acgc::division_pool_core")
def _pool_core(src: torch.Tensor, outer: int, length: int, inner: int, blk: int) -> torch.Tensor:
    """Average ``blk``-tiles of the middle axis of ``src`` viewed as (outer, length, inner)."""
    lo_len = triton.cdiv(length, blk)
    n_rows = outer * lo_len
    dst = torch.empty(n_rows * inner, dtype=torch.float32, device=src.device)
    br, bi = _tile_shape(n_rows, inner)
    wrap_triton(_pool_kernel)[(triton.cdiv(n_rows, br), triton.cdiv(inner, bi))](
        src,
        dst,
        n_rows,
        length,
        lo_len,
        inner,
        blk,
        BR=br,
        BI=bi,
        IDX64=src.numel() + br * blk * (inner + bi) >= 2**31,  # + the last block's overhang
        **LAUNCH_OPTIONS,
    )
    return dst


def _lowpass(x: torch.Tensor, blk: int, canon: tuple[int, int, int, int, bool]) -> torch.Tensor:
    """Float32 tile averages of contiguous ``x``, flat in (O, A2, B2, W2) order."""
    o, a, b, w, last_pooled = canon
    flat = x.reshape(-1)
    out, w2 = flat, w
    if last_pooled:  # the reference pools the last pooled axis first
        out, w2 = _pool_core(out, o * a * b, w, 1, blk), triton.cdiv(w, blk)
    b2 = triton.cdiv(b, blk)
    if b > 1:
        out = _pool_core(out, o * a, b, w2, blk)
    if a > 1:
        out = _pool_core(out, o, a, b2 * w2, blk)
    return flat.to(torch.float32, copy=True) if out is flat else out  # nothing pooled


@eager_or_op("lightning_acgc::division_tile_core")
def _tile_core(
    a: torch.Tensor,
    low: torch.Tensor,
    zbits: torch.Tensor | None,
    min_pos: torch.Tensor | None,
    o: int,
    a_len: int,
    b_len: int,
    w: int,
    last_pooled: bool,
    blk: int,
    decode: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``a - up(low)`` (float32) or the decoded ``clamp(a + up(low))`` in ``dtype``."""
    n_rows = o * a_len * b_len
    out_dtype = dtype if decode else torch.float32
    out = torch.empty(n_rows * w, dtype=out_dtype, device=a.device)
    br, bc = _tile_shape(n_rows, w)
    has_zero = zbits is not None
    wrap_triton(_tile_kernel)[(triton.cdiv(n_rows, br), triton.cdiv(w, bc))](
        a,
        low,
        out.view(torch.int16) if out_dtype == torch.bfloat16 else out,
        zbits if has_zero else low,
        min_pos if min_pos is not None else low,
        n_rows,
        w,
        a_len,
        b_len,
        triton.cdiv(a_len, blk),
        triton.cdiv(b_len, blk),
        triton.cdiv(w, blk) if last_pooled else w,
        blk,
        torch.finfo(dtype).max,
        BR=br,
        BC=bc,
        LAST_POOLED=last_pooled,
        DECODE=decode,
        HAS_ZERO=has_zero,
        HAS_MIN=min_pos is not None,
        OUT_KIND=_DTYPES.index(out_dtype),
        IDX64=(n_rows + br) * (w + bc) >= 2**31,
        **LAUNCH_OPTIONS,
    )
    return out


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block={block!r} must be an integer > 0")


def division_lowpass_triton(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block average pool of ``x`` over
    :func:`~lightning_acgc.kernels.division.reference.pool_axes`, as
    :func:`~lightning_acgc.kernels.division.reference.division_lowpass_ref` (float32 sums
    in tile order).

    Args:
        x: contiguous float32/float16/bfloat16 tensor of 1 to 5 dimensions.
        block: tile edge.

    Returns:
        float32 averages of the pooled shape.

    Raises:
        RuntimeError: Triton cannot run on ``x``'s device.
        TypeError: unsupported dtype.
        ValueError: bad ``block``, non-contiguous ``x``, or 0-d / more than 5-D ``x``.
    """
    _check_block(block)
    check_device(x, "x")
    check_dtype(x, "x", _DTYPES)
    check_contiguous(x, "x")
    canon = _canonical(x.shape)
    if canon is None:
        raise ValueError(f"x has {x.ndim} dimensions; the kernels take 1 to 5")
    axes = pool_axes(x.ndim)
    shape = [-(-s // block) if i in axes else s for i, s in enumerate(x.shape)]
    if x.numel() == 0:
        return torch.empty(shape, dtype=torch.float32, device=x.device)
    return _lowpass(x, block, canon).view(shape)


def division_encode_triton(
    x: torch.Tensor,
    block: int,
    residual_bits: int,
    group_size: int,
    low_dtype: torch.dtype,
    seed: int,
    noise: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Encode ``x`` in the format of
    :func:`~lightning_acgc.kernels.division.reference.division_encode_ref`.

    Args:
        x: non-empty float32/float16/bfloat16 tensor on a CUDA device (or any device under
            ``TRITON_INTERPRET=1``); a non-contiguous one is copied first.
        block: tile edge of the average pool.
        residual_bits: bits per residual value (1, 2, 4, 8).
        group_size: residual values per quant group (multiple of 8).
        low_dtype: dtype of the stored averages (float32 where they would overflow it).
        seed: Philox seed of the residual's stochastic rounding.
        noise: optional U[0, 1) noise of shape (G, group_size) replacing the Philox draw;
            the payload then equals ``division_encode_ref(..., noise=noise)``.

    Returns:
        The payload dict.

    Raises:
        RuntimeError: Triton cannot run on ``x``'s device.
        TypeError: unsupported dtype of ``x`` or ``low_dtype``.
        ValueError: bad ``block`` or empty ``x`` (and the quant kernel's argument errors).
    """
    _check_block(block)
    check_device(x, "x")
    check_dtype(x, "x", _DTYPES)
    if low_dtype not in _LOW_DTYPES:
        raise TypeError(f"low_dtype={low_dtype} is not supported; allowed: {list(_LOW_DTYPES)}")
    if x.numel() == 0:
        raise ValueError("x is empty; the division codec keeps empty tensors as they are")
    canon = _canonical(x.shape)
    lo, hi = torch.aminmax(x)
    lo_f, hi_f = float(lo), float(hi)  # one host sync; the rare cases depend on it
    rare = canon is None or not (math.isfinite(lo_f) and math.isfinite(hi_f))
    if not rare and max(abs(lo_f), abs(hi_f)) > _FP32_MAX / 2:
        rare = True  # x - mean may overflow: the reference keeps such elements exactly
    low32 = None
    if not rare:
        x = x.contiguous()
        low32 = _lowpass(x, block, canon)
        rare = not bool(torch.isfinite(low32).all())  # float32 sums overflowed
    if rare:
        # NaN/inf, huge values or unsupported layouts: the reference's code, with the
        # Triton quant and mask kernels.
        args = (x, block, residual_bits, group_size, low_dtype, seed, noise)
        return division_encode_with(_TRITON_KERNELS, *args)
    low = low32.to(low_dtype)
    if low_dtype != torch.float32 and not bool(torch.isfinite(low).all()):
        low = low32  # averages beyond low_dtype's range: keep them in float32
    o, a_len, b_len, w, last_pooled = canon
    r = _tile_core(x, low, None, None, o, a_len, b_len, w, last_pooled, block, False, x.dtype)
    q = quant_encode_triton(r, residual_bits, group_size, seed, noise=noise)
    axes = pool_axes(x.ndim)
    payload = {
        "low": low.view([-(-s // block) if i in axes else s for i, s in enumerate(x.shape)]),
        "codes": q["codes"],
        "lo": q["lo"],
        "scale": q["scale"],
        "res_exc_idx": q["exc_idx"],
        "res_exc_val": q["exc_val"],
        "exc_idx": torch.empty(0, dtype=torch.int64, device=x.device),
        "exc_val": torch.empty(0, dtype=x.dtype, device=x.device),
    }
    if lo_f == 0 and hi_f > 0:  # non-negative with exact zeros: keep the zero pattern
        payload.update(zero_pattern(x, mask_pack_triton))
    elif lo_f > 0:  # positive: decodes stay positive (reference.py's format)
        payload["min_pos"] = torch.tensor([lo_f], dtype=torch.float32, device=x.device)
    return payload


def division_decode_triton(
    payload: dict[str, torch.Tensor],
    shape: Sequence[int],
    dtype: torch.dtype,
    block: int,
    residual_bits: int,
    group_size: int,
) -> torch.Tensor:
    """Decode a ``division`` payload (from either path) to a tensor of ``shape``, ``dtype``.

    Args:
        payload: as :func:`division_encode_triton` or the reference writes it.
        shape: shape of the encoded tensor.
        dtype: dtype of the encoded tensor (float32, float16 or bfloat16).
        block: tile edge of the average pool.
        residual_bits: bits per residual value.
        group_size: residual values per quant group.

    Returns:
        A new tensor equal to ``division_decode_ref`` with the same arguments.

    Raises:
        RuntimeError: Triton cannot run on the payload's device.
        TypeError: unsupported ``dtype``.
        ValueError: bad ``block``, or payload sizes that do not fit ``shape``.
    """
    _check_block(block)
    if dtype not in _DTYPES:
        raise TypeError(f"dtype={dtype} is not supported; allowed: {[str(d) for d in _DTYPES]}")
    shape = torch.Size(shape)
    low = payload["low"]
    check_device(low, "payload['low']")
    canon = _canonical(shape)
    if canon is None:
        args = (payload, shape, dtype, block, residual_bits, group_size)
        return division_decode_with(_TRITON_KERNELS, *args)
    numel = shape.numel()
    axes = pool_axes(len(shape))
    expected = tuple(-(-s // block) if i in axes else s for i, s in enumerate(shape))
    if tuple(low.shape) != expected:
        raise ValueError(f"payload['low'] has shape {tuple(low.shape)}; expected {expected}")
    qp = {
        "codes": payload["codes"],
        "lo": payload["lo"],
        "scale": payload["scale"],
        "exc_idx": payload["res_exc_idx"],
        "exc_val": payload["res_exc_val"],
    }
    r = quant_decode_triton(qp, residual_bits, group_size, numel, torch.float32)
    zbits = payload.get("zero_mask")
    min_pos = payload.get("min_pos")
    if zbits is not None:
        check_contiguous(zbits, "payload['zero_mask']")
        if zbits.numel() * 8 < numel:
            raise ValueError(f"payload['zero_mask'] holds fewer than {numel} bits")
    o, a_len, b_len, w, last_pooled = canon
    out = _tile_core(
        r, low.contiguous(), zbits, min_pos, o, a_len, b_len, w, last_pooled, block, True, dtype
    )
    return restore_exceptions(out, payload["exc_idx"], payload["exc_val"]).view(shape)
