"""Error-bounded lossy coding (SZ/COMET spirit) — pure-torch reference (the specification).

Every element comes back with ``|x - x̂| <= eb`` in the output dtype, guaranteed: the
encoder decodes what it wrote, compares with ``x`` and keeps every violator exactly.

Format (shared with the Triton kernels). ``x`` is flattened and viewed as ``G`` groups of
``group_size`` values (a multiple of 8; the tail is padded with the last value, see
:func:`~lightning_acgc.kernels.quant.group_view`). Each group is one of:

* *constant* (all values equal): ``width 0``, ``step 0``; decodes to ``lo``.
* *coded*: ``width b`` in ``0..16``; code ``q`` of ``b`` bits per value;
  ``x̂ = lo + q * step``. A *zero-kept* group (one that holds an exact 0 and another
  value) has a negative ``step`` (its sign bit is the flag): there code 0 is an exact
  zero and code ``q >= 1`` decodes to ``lo + (q - 1) * |step|``, where ``lo`` is at
  most the group's smallest nonzero value; in a group whose minimum is 0 (post-ReLU)
  ``lo`` is positive and at most its smallest positive value, so no positive value
  decodes to ``<= 0``.
* *raw*: ``width 255``; the values are kept in ``raw``. Used where the codes would
  need more than ``min(16, dtype bits - 1)`` bits or no positive step can meet the
  bound (e.g. a 1e30 range with eb=1e-3, or eb below the dtype's spacing).

Payload:

* ``width``: uint8 (G,), as above.
* ``lo``: float32 (G,), the value of code 0 (code 1 when zero-kept); 0 for raw groups.
* ``step``: float32 (G,), the step between codes, negative when zero-kept; 0 for
  constant and raw groups.
* ``codes``: uint8, the coded groups' codes back to back in group order. A group of
  width ``b`` takes ``group_size * b / 8`` bytes from byte ``(group_size / 8) * S``
  with ``S`` the sum of the widths of the coded groups before it (a cumsum). Inside a
  group the codes form a little-endian bit stream: code ``i`` holds bits
  ``[b*i, b*i + b)``, and stream bit ``k`` is bit ``k % 8`` of byte ``k // 8``.
* ``raw``: the raw groups' ``group_size`` values each, flat, in the input dtype.
* ``exc_idx``/``exc_val``: sorted flat int64 indices and the original values of
  NaN/inf elements and of every element whose decoded value would miss the bound.
* ``bound``: float64 0-d, the absolute bound ``eb`` used (not needed to decode).

Decoding is ``x̂ = fl32(fl32(q' * |step|) + lo)`` in float32 with two separate
roundings (no FMA; ``q' = q`` or ``q - 1`` when zero-kept), clamped to the dtype's
finite range, then cast to the dtype; raw groups and exceptions overwrite their
elements.

How the encoder picks a group's step (the decoder does not need to know), with ``M``
the group's largest magnitude plus ``eb`` (a bound on every decoded magnitude):

* float16/bfloat16, when ``2*eb`` spans at least one dtype spacing ``ulp(M)``: the
  dtype's own grid, ``step = k * ulp(M)`` with ``k = floor(2*eb*(1 - 2^-6) / ulp(M))``
  and ``lo`` floored to a multiple of ``ulp(M)``. Every decoded value is then a dtype
  value computed exactly, so all of ``eb`` goes to the rounding of the codes.
* otherwise ``step = 2*(eb - E)*(1 - 2^-6)`` rounded down to float32, where
  ``E = 3*ulp32(M) + ulp_dtype(M)/2`` covers the float32 decode arithmetic and the
  final cast. A group with ``step <= 0`` (eb below the dtype's spacing) is raw.

The factor ``1 - 2^-6`` covers float32 rounding of ``(x - lo) / step`` at 16-bit codes.
Codes are ``round((x - lo) / step)`` (half to even, float32, one division; ``+1`` in
zero-kept groups), so violators of the bound are rare; the check finds any. With
``relative=True``, ``eb = error_bound * (max - min)`` over the tensor's finite values.

Sign pattern: exact zeros decode to +0.0 and positives of a group whose minimum is 0
stay positive. In a group holding both signs, a value within ``eb`` of 0 may decode to
0 or to the other sign (still within ``eb``).
"""

from __future__ import annotations

import sys

import torch

from lightning_acgc.kernels.bounded.plan import (
    MAX_WIDTH,
    RAW_WIDTH,
    abs_bound,
    check_args,
    f32_down,
    group_plan,
)
from lightning_acgc.kernels.common.groups import group_view
from lightning_acgc.kernels.common.nonfinite import fill_nonfinite_rows, restore_exceptions

__all__ = ["bounded_decode_ref", "bounded_encode_ref"]

_LITTLE_ENDIAN = sys.byteorder == "little"
_F32_MAX = torch.finfo(torch.float32).max


def _dequantize(
    q: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(G, group) float32 codes -> decoded values in ``dtype`` (the format's formula).

    Shared by the decoder and the encoder's check, so both compute the same values.
    Written with plain arithmetic: on CPU ``where``/``masked_fill`` are far slower.
    """
    zero_kept = torch.signbit(step)
    s = step.abs()[:, None]
    top = torch.finfo(dtype).max  # never round a finite value to inf (only nearer x)
    if not bool(zero_kept.any()):
        return (q * s).add_(lo[:, None]).clamp_(-top, top).to(dtype)
    qz = q - zero_kept[:, None].float()  # -1 exactly for the zeros of zero-kept groups
    out = (qz * s).add_(lo[:, None]).clamp_(-top, top)
    # Zeros: times 0, then + 0.0 turns the -0.0 of negative products into +0.0. The
    # mask is float arithmetic, min(qz + 1, 1): a bool mask is several times slower.
    return out.mul_(qz.add(1.0).clamp_(max=1.0)).add_(0.0).to(dtype)


def _words_to_bytes(words: torch.Tensor) -> torch.Tensor:
    """(W, M) int32 -> (M, 4 * W) uint8, each word's bytes little-endian."""
    nwords = words.shape[0]
    data = words.t().contiguous().view(-1).view(torch.uint8).view(-1, 4 * nwords)
    if not _LITTLE_ENDIAN:
        data = data.view(-1, nwords, 4).flip(-1).reshape(-1, 4 * nwords)
    return data


def _bytes_to_words(data: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_words_to_bytes`: (M, 4 * W) uint8 -> (W, M) int32."""
    if not _LITTLE_ENDIAN:
        data = data.view(data.shape[0], -1, 4).flip(-1).reshape(data.shape[0], -1)
    return data.contiguous().view(torch.int32).t().contiguous()


def _pack_block(q: torch.Tensor, b: int) -> torch.Tensor:
    """(8, M) int32, row ``i`` the ``i``-th code of each of M blocks, ``b`` bits each ->
    (M, b) uint8: each block's 8 codes as a ``b``-byte little-endian bit stream."""
    if b == 8:
        return q.t().to(torch.uint8)
    # Build each block in ceil(b / 4) int32 words (shifts past bit 31 drop the bits).
    w = torch.zeros((b + 3) // 4, q.shape[1], dtype=torch.int32, device=q.device)
    for i in range(8):
        k, s = divmod(b * i, 32)
        w[k] |= q[i] << s
        if s + b > 32:  # the code straddles two words
            w[k + 1] |= q[i] >> (32 - s)
    return _words_to_bytes(w)[:, :b]


def _unpack_block(data: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse of :func:`_pack_block`: (M, b) uint8 -> (8, M) int32 codes."""
    if b == 8:
        return data.t().to(torch.int32)
    nwords = (b + 3) // 4
    buf = torch.zeros(data.shape[0], 4 * nwords, dtype=torch.uint8, device=data.device)
    buf[:, :b] = data
    w = _bytes_to_words(buf)
    mask = (1 << b) - 1
    rows = []
    for i in range(8):
        k, s = divmod(b * i, 32)
        if s + b <= 32:
            rows.append((w[k] >> s) & mask)
        else:  # ``>>`` is arithmetic: drop the sign copies before joining the high part
            low = (w[k] >> s) & ((1 << (32 - s)) - 1)
            rows.append(low | ((w[k + 1] << (32 - s)) & mask))
    return torch.stack(rows)


def _coded_widths(width: torch.Tensor) -> list[int]:
    """The distinct code widths ``1..MAX_WIDTH`` present (0 and raw groups store no codes)."""
    counts = torch.bincount(width.to(torch.int64), minlength=RAW_WIDTH + 1).tolist()
    return [b for b in range(1, MAX_WIDTH + 1) if counts[b] > 0]


def _row_offsets(width: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per group, the first row (of ``group_size / 8`` bytes) of its codes; and the
    number of rows of all groups."""
    w = width.to(torch.int64)
    w = w * (width != RAW_WIDTH)
    ends = torch.cumsum(w, 0)
    return ends - w, int(ends[-1]) if ends.numel() else 0


def _pack_groups(q: torch.Tensor, width: torch.Tensor, group_size: int) -> torch.Tensor:
    """(G, group) float32 codes -> the ``codes`` byte stream of the coded groups."""
    dev, num_groups = q.device, q.shape[0]
    rows_per_group = group_size // 8
    offsets, total_rows = _row_offsets(width)
    codes = torch.zeros(total_rows, rows_per_group, dtype=torch.uint8, device=dev)
    for b in _coded_widths(width):
        gi = (width == b).nonzero().view(-1)
        qb = q if gi.numel() == num_groups else q.index_select(0, gi)
        qt = torch.empty(8, qb.numel() // 8, dtype=torch.int32, device=dev)
        qt.copy_(qb.view(-1, 8).t())
        data = _pack_block(qt, b).reshape(-1, rows_per_group)
        rows = (offsets[gi, None] + torch.arange(b, device=dev)).view(-1)
        codes.index_copy_(0, rows, data)
    return codes.view(-1)


def _unpack_groups(codes: torch.Tensor, width: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`_pack_groups`: (G, group) float32 codes (0 where none)."""
    dev, num_groups = codes.device, width.numel()
    rows_per_group = group_size // 8
    offsets, _ = _row_offsets(width)
    rows_of = codes.view(-1, rows_per_group)
    q = None
    for b in _coded_widths(width):
        gi = (width == b).nonzero().view(-1)
        rows = (offsets[gi, None] + torch.arange(b, device=dev)).view(-1)
        qt = _unpack_block(rows_of.index_select(0, rows).view(-1, b), b)
        qb = torch.empty(qt.shape[1], 8, dtype=torch.float32, device=dev).copy_(qt.t())
        if gi.numel() == num_groups:
            return qb.view(num_groups, group_size)
        if q is None:
            q = torch.zeros(num_groups, group_size, dtype=torch.float32, device=dev)
        q.index_copy_(0, gi, qb.view(-1, group_size))
    if q is None:  # constant and raw groups only
        q = torch.zeros(num_groups, group_size, dtype=torch.float32, device=dev)
    return q


def bounded_encode_ref(
    x: torch.Tensor, error_bound: float, group_size: int, relative: bool = False
) -> dict[str, torch.Tensor]:
    """Encode a non-empty float32/float16/bfloat16 tensor so that every element decodes
    within the absolute bound (``error_bound``, or ``error_bound * (max - min)`` of the
    finite values when ``relative``); see the module docstring for the format.

    Raises:
        ValueError: unsupported dtype, empty tensor, bad ``group_size`` or bound.
    """
    check_args(x.dtype, group_size)
    if not error_bound > 0 or error_bound == float("inf"):
        raise ValueError(f"error_bound={error_bound!r} must be a finite number > 0")
    n = x.numel()
    if n == 0:
        raise ValueError("x is empty; keep empty tensors raw")
    dtype, dev = x.dtype, x.device
    x_in = group_view(x, group_size)  # float32 (G, group_size), exact for every dtype
    xg = x_in
    num_groups = xg.shape[0]
    lo, hi = xg.amin(dim=1), xg.amax(dim=1)  # (faster than aminmax on CPU)
    bad_idx, has_finite = None, None
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        xg, bad_idx, _ = fill_nonfinite_rows(xg)
        lo, hi = xg.amin(dim=1), xg.amax(dim=1)
        per_group = torch.bincount(bad_idx // group_size, minlength=num_groups)
        has_finite = per_group < group_size
    eb = abs_bound(lo, hi, has_finite, error_bound, relative)

    plan = group_plan(
        lo,
        hi,
        eb,
        dtype,
        has_zero=lambda: xg.abs().amin(dim=1) == 0,
        # smallest positive value: zeros pushed to float32 max
        min_pos=lambda: torch.sign(xg).sub_(1.0).mul_(-_F32_MAX).add_(xg).amin(dim=1),
    )
    width, lo_p, step_p = plan.width, plan.lo, plan.step
    coded, raw, zero_kept = plan.coded, plan.raw, plan.zero_kept
    viol = None
    codes = torch.zeros(0, dtype=torch.uint8, device=dev)
    if bool(coded.any()):
        q = (xg - lo_p[:, None]).div_(torch.where(coded, step_p.abs(), 1.0)[:, None]).round_()
        if bool((zero_kept & coded).any()):
            # Codes 1.. for nonzero values, 0 for zeros (other groups hold no zeros, or
            # are constant with codes 0 anyway).
            q.add_(zero_kept[:, None].float()).mul_(torch.sign(xg).abs_())  # 0 at zeros
        # Check: decode as the decoder will; every violator becomes an exception.
        # Constant groups decode exactly (and eb > 0 here); raw ones are masked.
        dev_abs = _dequantize(q, lo_p, step_p, dtype).float().sub_(xg).abs_()
        if bool(raw.any()):
            dev_abs.mul_(coded[:, None].float())  # raw groups decode to 0 here: finite
        viol = ~(dev_abs < f32_down(eb))  # strict: guarantees |x - x̂| <= eb
        codes = _pack_groups(q, width, group_size)
    if viol is not None:
        if bad_idx is not None:
            viol.view(-1)[bad_idx] = True
        exc_idx = viol.view(-1).nonzero().view(-1)  # sorted
    elif bad_idx is not None:
        exc_idx = bad_idx
    else:
        exc_idx = torch.zeros(0, dtype=torch.int64, device=dev)
    exc_idx = exc_idx[exc_idx < n]  # padding copies of the last value
    exc_val = x_in.reshape(-1)[exc_idx].to(dtype)
    raw_vals = xg.index_select(0, raw.nonzero().view(-1)).to(dtype).reshape(-1)
    return {
        "width": width,
        "lo": lo_p,
        "step": step_p,
        "codes": codes,
        "raw": raw_vals,
        "exc_idx": exc_idx,
        "exc_val": exc_val,
        "bound": eb,
    }


def bounded_decode_ref(
    payload: dict[str, torch.Tensor],
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Flat tensor of ``numel`` decoded values in ``dtype``."""
    check_args(dtype, group_size)
    width, lo, step = payload["width"], payload["lo"], payload["step"]
    q = _unpack_groups(payload["codes"], width, group_size)
    out = _dequantize(q, lo, step, dtype)
    raw = payload["raw"]
    if raw.numel():
        gi = (width == RAW_WIDTH).nonzero().view(-1)
        out.index_copy_(0, gi, raw.view(-1, group_size))
    flat = out.view(-1)[:numel]
    return restore_exceptions(flat, payload["exc_idx"], payload["exc_val"])
