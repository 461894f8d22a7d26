"""Per-group stochastic quantization (ActNN/GACT style) — pure-torch reference (the
specification; the compiled CPU path and the Triton kernels write the same format).

Format:

* ``codes``: uint8, the ``bits``-bit codes of all ``G * group_size`` values, packed by
  :func:`lightning_acgc.kernels.common.bitpack.pack_codes` (the tail group is padded
  with the tensor's last value).
* ``lo``: per group, the value of code 0 (or of code 1, see below).
* ``scale``: per group, the step between codes. A negative sign bit marks a *zero-kept*
  group: a group whose minimum is exactly 0 (e.g. after ReLU). There code 0 is an exact
  zero and codes ``1..2^b-1`` cover ``[smallest positive, max]``, so zeros stay zeros and
  no positive value ever decodes to 0 (the ReLU mask is kept). 1-bit groups never use it.
* ``lo`` and ``scale`` are float32 (``meta="fp32"``) or bfloat16 (``meta="bf16"``: 32
  instead of 64 bits per group). bfloat16 metadata is rounded in a directed way, ``lo``
  down and the step up so that ``lo + step * top >= max``, and the codes are computed
  with the rounded values: every value stays within one step and the rounding unbiased.
  A tensor whose bfloat16 metadata would not be exact enough (a zero-kept group whose
  smallest positive value rounds down to 0, a value beyond bfloat16's range) is written
  with float32 metadata; ``lo.dtype`` says which.
* ``exc_idx``/``exc_val``: flat indices and original values of NaN/inf elements.

Rounding is ``floor((x - lo) * inv + u)``, ``inv = 1 / step``, with ``u`` from a
counter-based hash of (seed, element index) (:func:`hash_uniform`): unbiased to within
2**-16 of a step, reproducible from the stored seed, and computable anywhere. (Rounding
to the nearest code, u = 0.5, was built and measured: a single step's gradient error fell
1.3-2.7x at equal bits, and acgc kept 7-18% more on the recipes, but in paired-seed fits
one of three char-LM seeds ended 15% above plain's validation loss and, recalibrating every
10 steps with every measured error near e, 9.5% above: a deterministic error points the
same way step after step. So the rounding stays stochastic.) Decoding
computes ``lo + q * step`` as one fused multiply-add (``torch.addcmul``). A tensor whose
step does not fit float32 (a range beyond 3.4e38 at 1 bit) is not quantized: the codec
keeps it as it is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lightning_acgc.kernels.common.bitpack import pack_codes, unpack_codes
from lightning_acgc.kernels.common.groups import group_view
from lightning_acgc.kernels.common.nonfinite import fill_nonfinite_rows, restore_exceptions

__all__ = [
    "META_FORMATS",
    "GroupMeta",
    "decode_params",
    "group_meta",
    "hash_key",
    "hash_uniform",
    "quant_decode_ref",
    "quant_encode_ref",
    "uniform_noise",
    "without_inf_steps",
]

META_FORMATS = ("fp32", "bf16")
_M32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _lowbias32_t(x: torch.Tensor) -> torch.Tensor:
    """:func:`_lowbias32` on an int64 tensor of values below 2**32 (products wrap)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hash_key(seed: int) -> int:
    """The 32-bit key of a seed (its low 63 bits) for :func:`hash_uniform`."""
    seed = int(seed) & 0x7FFF_FFFF_FFFF_FFFF
    return _lowbias32((seed & _M32) ^ _lowbias32(seed >> 32))


def hash_uniform(numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """U[0, 1) float32 noise of element ``i``: a 16-bit half of the hash of its pair
    ``p = i >> 1``, ``h = lowbias32((p mod 2**32) ^ lowbias32((p >> 32) ^ key))``,
    ``key = hash_key(seed)``; element ``2p`` takes ``h & 0xFFFF``, ``2p + 1`` takes
    ``h >> 16``, times ``2**-16``. A pure function of (seed, i): any block of elements
    starting at an even index can be drawn on its own. One hash serves two elements (the
    compiled encode spends most of its time on the hash); the rounding stays unbiased to
    within 2**-16 of a step.

    Example:
        >>> u = hash_uniform(5, seed=3)
        >>> bool(((u >= 0) & (u < 1)).all()), torch.equal(u, hash_uniform(5, seed=3))
        (True, True)
    """
    pairs = (numel + 1) // 2
    p = torch.arange(pairs, dtype=torch.int64, device=device)
    key = hash_key(seed)
    if pairs <= 2**32:
        kh = torch.full((), _lowbias32(key), dtype=torch.int64, device=device)
    else:
        kh = _lowbias32_t((p >> 32) ^ key)
    h = _lowbias32_t((p & _M32) ^ kh)
    halves = torch.stack([h & 0xFFFF, h >> 16], dim=1).view(-1)[:numel]
    return halves.to(torch.float32).mul_(2.0**-16)


def uniform_noise(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """U[0, 1) float32 noise from a private generator (never the global RNG), for tests
    that inject noise."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32)


def _min_positive_rows(xg: torch.Tensor) -> torch.Tensor:
    """Smallest positive value of each row, for rows whose values are all >= 0 (other
    rows give meaningless values). For float32, the bit patterns of non-negative floats
    are ordered like the floats: ``(bits - 1) & 0x7FFFFFFF`` turns +0 and -0 into the
    largest int and keeps the order of positives, so one integer ``amin`` finds it."""
    if xg.dtype != torch.float32:
        return torch.where(xg > 0, xg, torch.inf).amin(dim=1)
    bits = ((xg.view(torch.int32) - 1) & 0x7FFFFFFF).amin(dim=1) + 1
    return bits.view(torch.float32)


def _bf16_down(v: torch.Tensor) -> torch.Tensor:
    """float32 -> the largest bfloat16 <= v (as float32); -0.0 and 0.0 stay."""
    b = v.view(torch.int32)
    t = b & -65536  # 0xFFFF0000: toward zero
    t = torch.where((b < 0) & ((b & 0xFFFF) != 0), t + 65536, t)  # negative: away from 0
    return t.view(torch.float32)


def _bf16_up(v: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> the smallest bfloat16 >= v (as float32)."""
    b = v.view(torch.int32)
    t = b & -65536
    return torch.where((b & 0xFFFF) != 0, t + 65536, t).view(torch.float32)


class GroupMeta(NamedTuple):
    """Per-group parameters of one encode: ``lo``, ``step``, ``inv`` (0 where the step
    is 0), ``top`` (highest code before the zero-kept shift), ``zero_kept``; float32, or
    float64 when ``wide`` (a range or inverse beyond float32: the reference's slow path).
    ``stored`` is the dtype ``lo``/``scale`` are written in."""

    lo: torch.Tensor
    step: torch.Tensor
    inv: torch.Tensor
    top: torch.Tensor
    zero_kept: torch.Tensor
    wide: bool
    stored: torch.dtype


def group_meta(
    lo: torch.Tensor, hi: torch.Tensor, min_pos: torch.Tensor, bits: int, meta: str = "fp32"
) -> GroupMeta:
    """Per-group parameters from the groups' min, max and smallest positive value (finite
    float32). The specification of the metadata formats: the compiled CPU path repeats
    this arithmetic in C (``group_param`` in ``common/csrc/fastcpu.h``), held bit-identical
    to it by ``tests/test_kernels_cpu.py``.

    Example:
        >>> m = group_meta(torch.tensor([0.0]), torch.tensor([3.0]), torch.tensor([1.0]), 2)
        >>> m.lo.item(), m.step.item(), m.zero_kept.item()
        (1.0, 1.0, True)
    """
    levels = float(2**bits - 1)
    zero_kept = (lo == 0) & (hi > 0) if bits > 1 else torch.zeros_like(lo, dtype=torch.bool)
    lo = torch.where(zero_kept, min_pos, lo) if bits > 1 else lo
    top = torch.where(zero_kept, lo.new_tensor(levels - 1), lo.new_tensor(levels))
    if meta == "bf16":
        lo_b = _bf16_down(lo.contiguous()) + 0.0
        step_b = _bf16_up(((hi - lo_b) / top).clamp_(min=0).contiguous())
        short = lo_b + top * step_b < hi  # float32 rounding of the division: one more ulp
        step_b = torch.where(short, _bf16_up(torch.nextafter(step_b, hi.new_tensor(1e38))), step_b)
        inv_b = torch.where(step_b > 0, 1.0 / step_b, torch.zeros_like(step_b))
        ok = torch.isfinite(lo_b) & torch.isfinite(step_b) & torch.isfinite(inv_b)
        ok &= ~(zero_kept & (lo_b <= 0))
        if bool(ok.all()):
            return GroupMeta(lo_b, step_b, inv_b, top, zero_kept, False, torch.bfloat16)
    step = (hi - lo) / top
    wide = not (torch.isfinite(step).all() and bool((1.0 / step[step > 0]).isfinite().all()))
    if wide:  # ranges beyond float32, or denormal steps whose inverse overflows
        lo, step = lo.double(), (hi.double() - lo.double()) / top
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    return GroupMeta(lo, step, inv, top, zero_kept, wide, torch.float32)


def quant_encode_ref(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    seed: int,
    noise: torch.Tensor | None = None,
    meta: str = "fp32",
) -> dict[str, torch.Tensor]:
    """Quantize a non-empty floating tensor.

    ``noise`` (float32 U[0, 1), shape (G, group_size)) overrides the seeded draw
    :func:`hash_uniform` (the Triton kernel's tests inject it); the arithmetic is the
    same, ``floor((x - lo) * inv + u)``, so paths can be compared bit for bit.
    """
    xg = group_view(x, group_size)
    exc_idx = torch.empty(0, dtype=torch.int64, device=x.device)
    exc_val = torch.empty(0, dtype=x.dtype, device=x.device)
    lo, hi = xg.amin(dim=1), xg.amax(dim=1)  # cheaper than aminmax(dim=1) on CPU
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        xg, exc_idx, exc_val = fill_nonfinite_rows(xg)
        keep = exc_idx < x.numel()  # padding copies of a non-finite last value
        exc_idx, exc_val = exc_idx[keep], exc_val[keep].to(x.dtype)
        lo, hi = xg.amin(dim=1), xg.amax(dim=1)
    min_pos = _min_positive_rows(xg) if bits > 1 else lo
    m = group_meta(lo, hi, min_pos, bits, meta)
    if noise is None:
        noise = hash_uniform(xg.numel(), seed, x.device).view(xg.shape)
    xw = xg.double() if m.wide else xg
    t = (xw - m.lo[:, None]) * m.inv[:, None]
    t.add_(noise)
    # floor(t + u) clamped to [0, top]: clamping first, truncation is the floor.
    t.clamp_(min=0)
    torch.minimum(t, m.top[:, None].to(t.dtype), out=t)
    q = t.to(torch.uint8)
    if bits > 1:
        q += (xg != 0) & m.zero_kept[:, None]
    scale = torch.where(m.zero_kept, -m.step, m.step).to(m.stored)
    return {
        "codes": pack_codes(q.view(-1), bits),
        "lo": m.lo.to(m.stored) + 0.0,  # a zero minimum stored as +0.0
        "scale": scale,
        "exc_idx": exc_idx,
        "exc_val": exc_val,
    }


def without_inf_steps(payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """``payload``, or ``None`` where a group's step is stored as inf (beyond the
    metadata's float format: only the float64 path writes one).

    Example:
        >>> without_inf_steps({"scale": torch.tensor([1.0, float("inf")])}) is None
        True
    """
    return payload if bool(torch.isfinite(payload["scale"]).all()) else None


def decode_params(
    lo: torch.Tensor, scale: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lo, step, zero_kept)`` of a payload, float32 (float64 where some
    ``lo + levels * step`` overflows float32)."""
    zero_kept = torch.signbit(scale)
    lo, step = lo.float(), scale.float().abs()
    if not torch.isfinite(lo + float(2**bits - 1) * step).all():
        lo, step = lo.double(), step.double()
    return lo, step, zero_kept


def quant_decode_ref(
    payload: dict[str, torch.Tensor],
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Flat tensor of ``numel`` decoded values in ``dtype``."""
    lo, step, zero_kept = decode_params(payload["lo"], payload["scale"], bits)
    groups = lo.numel()
    q = unpack_codes(payload["codes"], bits, groups * group_size).view(groups, group_size)
    qf = q.to(lo.dtype)
    if bool(zero_kept.any()):
        # Zero-kept groups: code c >= 1 is lo + (c - 1) * step, code 0 an exact +0.0.
        # Done in float arithmetic (bool masks are several times slower on CPU):
        # keep = min(c + (1 - zk), 1) is 0 exactly there, and v * keep + 0.0 is +0.0.
        zk = zero_kept[:, None].to(lo.dtype)
        out = torch.addcmul(lo[:, None], qf - zk, step[:, None])
        keep = qf.add_(1.0 - zk).clamp_(max=1.0)
        out = torch.addcmul(out.new_zeros(()), out, keep)
    else:
        out = torch.addcmul(lo[:, None], qf, step[:, None])
    flat = out.view(-1)[:numel]
    if flat.dtype == torch.float64 and dtype != torch.float64:
        # lo + top * step rounds a hair past the largest float (the step was rounded up):
        # every value was finite, so it decodes to one (the clamp only moves toward it)
        big = torch.finfo(torch.float32).max
        flat = flat.clamp(-big, big)
    return restore_exceptions(flat.to(dtype), payload["exc_idx"], payload["exc_val"])
