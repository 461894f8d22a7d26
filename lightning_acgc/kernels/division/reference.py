"""DIVISION dual-precision coding — pure-torch reference (the specification).

DIVISION (ICML 2023) keeps the low-frequency part of an activation map at higher
precision and the high-frequency residual at very few bits.

Pooled axes (:func:`pool_axes`): a 4-D (N, C, H, W) tensor is pooled over H and W in
``block x block`` tiles, a 5-D one over its three last axes, a 3-D (N, L, D) sequence
over L (axis 1), 2-D and 1-D tensors over their last axis; a 0-d tensor is not pooled.
A partial tile at an edge is averaged over its real elements (no zero padding).

Format (shared with the Triton kernels):

* ``low``: the block averages, the shape of the input with each pooled axis of size
  ``L`` shrunk to ``ceil(L / block)``; dtype ``low_dtype``, or float32 for a tensor whose
  averages would overflow ``low_dtype`` (then ``low.dtype`` says so). Averages are taken
  in float32 (float64 where a float32 sum overflows).
* ``codes``, ``lo``, ``scale``: the float32 residual ``r = x - upsample(low)`` (flat,
  row-major, the *stored* ``low`` upsampled, so that rounding ``low`` costs nothing)
  in the format of :mod:`lightning_acgc.kernels.quant.reference` with ``residual_bits``,
  ``group_size`` and the seed.
* ``res_exc_idx``/``res_exc_val``: that format's exception list; always empty, since
  the residual is finite.
* ``exc_idx`` (int64) / ``exc_val`` (the input dtype): flat indices and exact values of
  the elements kept as they are: NaN/inf, and the rare finite value whose residual
  overflows float32. Before pooling each NaN/inf is replaced by the mean of the finite
  values of its tile (0 if there is none), so it neither moves the tile's average nor
  widens the residual's range.
* ``zero_mask`` (uint8, 1 bit per element, layout of :mod:`lightning_acgc.kernels.mask.reference`)
  and ``min_pos`` (float32, shape (1,), the smallest positive value): present only when
  the finite values are non-negative and some are exactly 0 (ReLU outputs). Decoding
  writes exact zeros there and clamps every other value to at least ``min_pos``, so the
  zero pattern is kept and no positive value decodes to 0 or below. ``min_pos`` alone (no
  mask): every finite value is positive (a softmax's denominator, a norm); decoding
  clamps every value to at least it. Without it a positive tensor decoded to values of
  -3 (2-bit residual of one-sided values in [1, 11]), and a backward dividing by it
  gave NaN.

Decoding: ``x_hat = clamp(upsample(low) + r_hat, +-finfo(dtype).max)``, the zero mask
applied, cast to the input dtype, the exceptions written back. Each element is within
one residual step ``|scale|`` of its quant group of the input (plus the final rounding to
the input dtype), and before the clamps ``E[x_hat] = x``: the residual's stochastic
rounding is unbiased.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from lightning_acgc.kernels.common.nonfinite import restore_exceptions
from lightning_acgc.kernels.division.pooling import (
    check_block_axes,
    division_lowpass_ref,
    division_upsample_ref,
    pool_axes,
    with_upsampled,
)
from lightning_acgc.kernels.mask.reference import mask_pack_ref, mask_unpack_ref
from lightning_acgc.kernels.quant.reference import quant_decode_ref, quant_encode_ref

__all__ = [
    "REFERENCE_KERNELS",
    "Kernels",
    "division_decode_ref",
    "division_decode_with",
    "division_encode_ref",
    "division_encode_with",
    "division_lowpass_ref",
    "division_upsample_ref",
    "pool_axes",
    "zero_pattern",
]

_FP32_MAX = torch.finfo(torch.float32).max


def _set_aside_nonfinite(
    xf: torch.Tensor, x: torch.Tensor, block: int, axes: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN/inf replaced by their tile's finite mean; their flat indices and exact values."""
    finite = torch.isfinite(xf)
    idx = (~finite).view(-1).nonzero().view(-1)
    vals = x.reshape(-1)[idx].clone()
    zeroed = torch.where(finite, xf, torch.zeros((), dtype=xf.dtype, device=xf.device))
    sums = division_lowpass_ref(zeroed, block, axes)
    if not torch.isfinite(sums).all():
        sums = division_lowpass_ref(zeroed.double(), block, axes)
    frac = division_lowpass_ref(finite.to(sums.dtype), block, axes)
    tile_mean = torch.where(frac > 0, sums / frac.clamp(min=1e-30), 0.0).float()
    fill = division_upsample_ref(tile_mean, xf.shape, block, axes)
    return torch.where(finite, xf, fill), idx, vals


class Kernels(NamedTuple):
    """The quant and mask functions a division encoder/decoder calls (reference, compiled
    CPU or Triton), with the signatures of the references; the optional fused steps
    compute the same bits as the torch code they replace (None: that torch code)."""

    quant_encode: Callable[..., dict[str, torch.Tensor]]
    quant_decode: Callable[..., torch.Tensor]
    mask_pack: Callable[[torch.Tensor], torch.Tensor]
    mask_unpack: Callable[[torch.Tensor, int], torch.Tensor]
    pool_axis: Callable[..., torch.Tensor] | None = None  # as _pool_axis
    zero_pattern: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None
    # (out, fmax, payload) -> out clamped, zero pattern applied (float32, in place)
    finish: Callable[[torch.Tensor, float, dict[str, torch.Tensor]], torch.Tensor] | None = None


REFERENCE_KERNELS = Kernels(quant_encode_ref, quant_decode_ref, mask_pack_ref, mask_unpack_ref)


def division_encode_with(
    kernels: Kernels,
    x: torch.Tensor,
    block: int,
    residual_bits: int,
    group_size: int,
    low_dtype: torch.dtype,
    seed: int,
    noise: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The encoder (the one place that writes the payload), calling ``kernels``; with
    ``noise`` the residual goes through the quant reference with that noise."""
    axes = check_block_axes(x.ndim, block, None)
    x0 = x.to(torch.float32, memory_format=torch.contiguous_format)
    xf = x0
    exc_idx = torch.empty(0, dtype=torch.int64, device=x.device)
    exc_val = torch.empty(0, dtype=x.dtype, device=x.device)
    lo, hi = torch.aminmax(xf)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):  # NaN propagates through aminmax
        xf, exc_idx, exc_val = _set_aside_nonfinite(xf, x, block, axes)
        lo, hi = torch.aminmax(xf)

    low32 = division_lowpass_ref(xf, block, axes, kernels.pool_axis)
    if not torch.isfinite(low32).all():  # float32 sums overflowed
        low32 = division_lowpass_ref(xf.double(), block, axes).float()
    low = low32.to(low_dtype)
    if low_dtype != torch.float32 and not torch.isfinite(low).all():
        low = low32  # averages beyond low_dtype's range: keep this tensor's in float32
    r = with_upsampled(xf, low.float(), block, axes, subtract=True)
    if max(abs(float(lo)), abs(float(hi))) > _FP32_MAX / 2:  # |x - mean| may overflow
        bad = ~torch.isfinite(r)
        if bool(bad.any()):
            idx = bad.view(-1).nonzero().view(-1)
            exc_idx = torch.cat([exc_idx, idx])
            exc_val = torch.cat([exc_val, x.reshape(-1)[idx]])
            r = r.masked_fill(bad, 0.0)

    if noise is not None:
        q = quant_encode_ref(r, residual_bits, group_size, seed, noise=noise)
    else:
        q = kernels.quant_encode(r, residual_bits, group_size, seed)
    payload = {
        "low": low,
        "codes": q["codes"],
        "lo": q["lo"],
        "scale": q["scale"],
        "res_exc_idx": q["exc_idx"],
        "res_exc_val": q["exc_val"],
        "exc_idx": exc_idx,
        "exc_val": exc_val,
    }
    if bool((lo == 0) & (hi > 0)):  # non-negative, with exact zeros: keep the zero pattern
        if kernels.zero_pattern is not None:
            payload.update(kernels.zero_pattern(x0))
        else:
            payload.update(zero_pattern(x0, kernels.mask_pack))
    elif bool(lo > 0):  # positive: decodes stay positive
        payload["min_pos"] = lo.float().reshape(1)
    return payload


def zero_pattern(
    x: torch.Tensor, pack_mask: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``zero_mask`` (packed by ``pack_mask``) and ``min_pos`` of a non-negative ``x``
    that holds exact zeros; shared by the torch and the Triton encoders."""
    inf = torch.full((), torch.inf, dtype=x.dtype, device=x.device)
    min_pos = torch.where(x > 0, x, inf).amin().float().reshape(1)
    return {"zero_mask": pack_mask(x == 0), "min_pos": min_pos}


def division_decode_with(
    kernels: Kernels,
    payload: dict[str, torch.Tensor],
    shape: Sequence[int],
    dtype: torch.dtype,
    block: int,
    residual_bits: int,
    group_size: int,
) -> torch.Tensor:
    """The decoder, calling ``kernels``."""
    shape = torch.Size(shape)
    axes = check_block_axes(len(shape), block, None)
    numel = shape.numel()
    qp = {
        "codes": payload["codes"],
        "lo": payload["lo"],
        "scale": payload["scale"],
        "exc_idx": payload["res_exc_idx"],
        "exc_val": payload["res_exc_val"],
    }
    r = kernels.quant_decode(qp, residual_bits, group_size, numel, torch.float32)
    out = with_upsampled(r.view(shape), payload["low"].float(), block, axes, subtract=False)
    fmax = torch.finfo(dtype).max
    if kernels.finish is not None:
        out = kernels.finish(out, fmax, payload)
    else:
        out = _finish(out, fmax, payload, kernels.mask_unpack)
    flat = out.reshape(-1).to(dtype)
    flat = restore_exceptions(flat, payload["exc_idx"], payload["exc_val"])
    return flat.view(shape)


def _finish(
    out: torch.Tensor,
    fmax: float,
    payload: dict[str, torch.Tensor],
    mask_unpack: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """The decode's last steps: clamp to the dtype's range and to ``min_pos``, then the
    zero pattern."""
    out = out.clamp_(-fmax, fmax)
    shape, numel = out.shape, out.numel()
    if "min_pos" in payload:
        out = torch.maximum(out, payload["min_pos"].view(()))
    if "zero_mask" in payload:
        out = out.masked_fill_(mask_unpack(payload["zero_mask"], numel).view(shape), 0.0)
    return out


def division_encode_ref(
    x: torch.Tensor,
    block: int,
    residual_bits: int,
    group_size: int,
    low_dtype: torch.dtype,
    seed: int,
    noise: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Encode a non-empty floating tensor (float32, float16 or bfloat16) in pure torch.

    Args:
        x: the tensor, any shape and strides.
        block: tile edge of the average pool.
        residual_bits: bits per residual value (1, 2, 4, 8).
        group_size: residual values sharing one min/scale pair (multiple of 8).
        low_dtype: dtype of the stored averages (float32 where they would overflow it).
        seed: seed of the residual's stochastic rounding.
        noise: U[0, 1) noise of shape (G, group_size) replacing the seeded draw, so that
            other implementations can be compared exactly.

    Returns:
        The payload described at the top of this module.
    """
    args = (x, block, residual_bits, group_size, low_dtype, seed, noise)
    return division_encode_with(REFERENCE_KERNELS, *args)


def division_decode_ref(
    payload: dict[str, torch.Tensor],
    shape: Sequence[int],
    dtype: torch.dtype,
    block: int,
    residual_bits: int,
    group_size: int,
) -> torch.Tensor:
    """Decode a payload of :func:`division_encode_ref` to a tensor of ``shape``, ``dtype``."""
    args = (payload, shape, dtype, block, residual_bits, group_size)
    return division_decode_with(REFERENCE_KERNELS, *args)
