"""The expected error of the ``quant`` codec's stochastic rounding, per saved tensor.

Stochastic rounding of a value at fraction f of a step s between two codes has variance
``f·(1 − f)·s²`` (it is unbiased). For a group of range R quantized to b bits the step
is ``R/(2^b − 1)``; in a *zero-kept* group (minimum exactly 0, b > 1) the zeros are exact
and the positives span ``2^b − 2`` steps from the smallest positive value. Summing that
exact expression over the values is cheaper than reasoning about the distribution: the
classic ``R²/(6·(2^b − 1)²)`` (f uniform) overstates the error of ReLU outputs, which
sit mostly near the bottom of their group's range, and of groups that are mostly zeros.
A tensor with such groups is infinitely wrong at 1 bit (its ReLU mask is not kept).

:func:`sr_variance` returns the mean per-element variance at each width of
:data:`~lightning_acgc.policies.bit_allocation.LADDER`, measured on (a regular sample of)
the tensor's groups; the AC-GC policy multiplies it by each tensor's sensitivity. Its
last width, ``HALF``, is the ``half`` codec's rounding to the nearest float16: an error
uniform within half an ulp, variance ulp²/12 (an upper bound: values float16 holds
exactly, zeros among them, have none); 0 for a 16-bit tensor, which ``half`` declines
and the engine keeps as it is (the 16-bit widths of mixed precision: read as the
float16 rounding of a float32 value, a calibration whose tensors were kept measured far
less than the model said, and κ fell by the most it may).
"""

from __future__ import annotations

import torch

from lightning_acgc.codecs.half import HALF_SOURCE, half_error_bound
from lightning_acgc.kernels.quant import group_view
from lightning_acgc.kernels.quant.cpu import sr_variance_sums_cpu
from lightning_acgc.policies.bit_allocation import QUANT_WIDTHS

__all__ = ["sr_variance"]


def sr_variance(x: torch.Tensor, group_size: int, max_groups: int = 2048) -> torch.Tensor:
    """Mean per-element variance of ``quant``'s stochastic rounding of ``x`` at each width
    of ``LADDER`` (float64, shape ``(len(LADDER),)``). Tensors with more than
    ``max_groups`` groups are measured on that many evenly spaced groups (deterministic).
    Non-finite values (kept exactly by the codec) count as zeros.

    Example:
        >>> x = torch.rand(4096) + 0.1
        >>> v = sr_variance(x, 256)
        >>> bool((v[:-1] > v[1:]).all())  # more bits, less error
        True
        >>> abs(float(v[1]) / (1 / 9 / 6) - 1) < 0.1  # uniform data: R²/(6·3²) at 2 bits
        True
        >>> float(v[7] / v[-1]) > 100  # float16 (HALF) against 8 bits
        True
        >>> float(sr_variance(x.bfloat16(), 256)[-1])  # a 16-bit tensor: kept as it is
        0.0
    """
    xg = group_view(x.detach(), group_size)
    if xg.shape[0] > max_groups:
        rows = torch.linspace(
            0, xg.shape[0] - 1, max_groups, dtype=torch.float32, device=xg.device
        ).long()
        xg = xg[rows]
    xg = torch.where(torch.isfinite(xg), xg, torch.zeros((), dtype=xg.dtype, device=xg.device))
    lo, hi = xg.amin(dim=1), xg.amax(dim=1)
    zero_kept = (lo == 0) & (hi > 0)
    min_pos = torch.where(xg > 0, xg, torch.inf).amin(dim=1)
    sums = sr_variance_sums_cpu(xg, lo, hi, min_pos, zero_kept)
    is_zero = None if sums is not None else xg == 0
    out = []
    for bits in QUANT_WIDTHS:
        if bits == 1 and bool(zero_kept.any()):
            # 1-bit groups keep no zeros: a positive value may decode to 0 and flip a
            # ReLU's mask, an error in δ the variance does not describe: never chosen.
            out.append(torch.tensor(torch.inf, dtype=torch.float64, device=x.device))
            continue
        if sums is not None:
            out.append(sums[bits - 1] / xg.numel())
            continue
        levels = float(2**bits - 1)
        kept = zero_kept if bits > 1 else torch.zeros_like(zero_kept)
        base = torch.where(kept, min_pos, lo)
        top = torch.where(kept, lo.new_tensor(levels - 1), lo.new_tensor(levels))
        step = (hi - base) / top
        inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
        t = (xg - base[:, None]) * inv[:, None]
        f = t - t.floor()
        var = f * (1 - f) * step[:, None].square()
        var = torch.where(kept[:, None] & is_zero, torch.zeros_like(var), var)
        out.append(var.double().mean())
    if x.dtype != HALF_SOURCE:  # HALF declines it: kept as it is, no error
        out.append(torch.zeros((), dtype=torch.float64, device=x.device))
        return torch.stack(out)
    ulp_sq = (2 * half_error_bound(xg)).double().square()  # HALF, LADDER's last width
    out.append(torch.where(xg != 0, ulp_sq / 12, torch.zeros_like(ulp_sq)).mean())
    return torch.stack(out)
