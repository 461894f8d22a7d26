"""Per-group stochastic quantization (ActNN/GACT style) — pure-torch reference and CPU path.

Format (shared with the Triton kernels):

* ``codes``: uint8, the ``bits``-bit codes of all ``G * group_size`` values, packed by
  :func:`lightning_acgc.kernels.bitpack.pack_codes` (the tail group is padded with the
  tensor's last value).
* ``lo``: float32 per group, the value of code 0 (or of code 1, see below).
* ``scale``: float32 per group, the step between codes. A negative sign bit marks a
  *zero-kept* group: a group whose minimum is exactly 0 (e.g. after ReLU). There code 0
  is an exact zero and codes ``1..2^b-1`` cover ``[smallest positive, max]``, so zeros
  stay zeros and no positive value ever decodes to 0 (the ReLU mask is kept).
  1-bit groups never use it.
* ``exc_idx``/``exc_val``: flat indices and original values of NaN/inf elements.

Rounding is ``floor(t + u)`` with ``u ~ U[0, 1)`` drawn from a generator seeded with the
stored seed: unbiased, and the same seed gives the same codes. Decoding computes
``lo + q * step`` as one fused multiply-add (``torch.addcmul``; the Triton kernel too).
A tensor whose step does not fit float32 (a range beyond 3.4e38 at 1 bit) is not
quantized: the codec keeps it as it is.
"""

from __future__ import annotations

import torch

from lightning_acgc.kernels.bitpack import pack_codes, unpack_codes
from lightning_acgc.kernels.dispatch import use_triton
from lightning_acgc.kernels.nonfinite import fill_nonfinite_rows, restore_exceptions

__all__ = [
    "group_view",
    "noise16",
    "quant_decode",
    "quant_decode_ref",
    "quant_encode",
    "quant_encode_ref",
    "uniform_noise",
]


def group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x`` flattened to float32 and viewed as (G, group_size); the tail is padded
    with the last value so that padding never widens a group's range."""
    flat = x.reshape(-1)
    flat = flat.float() if flat.dtype != torch.float32 else flat
    n = flat.numel()
    pad = -n % group_size
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.view(-1, group_size)


def uniform_noise(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """U[0, 1) float32 noise from a private generator (never the global RNG)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32)


def noise16(numel: int, seed: int, device: torch.device) -> torch.Tensor:
    """``numel`` uniform int16 values from a private generator, cheaply: three from each
    random 64-bit word (``random_`` fills only 63 bits, so the top 16 are not used).
    ``v * 2**-16 + 0.5 + 2**-17`` is uniform on 65536 points of (0, 1)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    words = torch.empty(-(-numel // 3), dtype=torch.int64, device=device).random_(generator=gen)
    return words.view(torch.int16).view(-1, 4)[:, :3].reshape(-1)[:numel]


def _min_positive_rows(xg: torch.Tensor) -> torch.Tensor:
    """Smallest positive value of each row, for rows whose values are all >= 0 (other
    rows give meaningless values). For float32, the bit patterns of non-negative floats
    are ordered like the floats: ``(bits - 1) & 0x7FFFFFFF`` turns +0 and -0 into the
    largest int and keeps the order of positives, so one integer ``amin`` finds it."""
    if xg.dtype != torch.float32:
        return torch.where(xg > 0, xg, torch.inf).amin(dim=1)
    bits = ((xg.view(torch.int32) - 1) & 0x7FFFFFFF).amin(dim=1) + 1
    return bits.view(torch.float32)


def quant_encode_ref(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    seed: int,
    noise: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Quantize a non-empty floating tensor.

    ``noise`` (float32 U[0, 1), shape (G, group_size)) overrides the seeded draw; with it
    the arithmetic is exactly the Triton kernel's, ``floor((x - lo) * inv + u)``, so the
    two can be compared bit for bit. The seeded draw uses 16-bit noise (:func:`noise16`)
    folded into one multiply-add, ``x * inv + (0.5 + 2**-17 - lo * inv) + v * 2**-16``:
    the same rounding rule up to an ulp of t, unbiased to within 2**-17 of a step, and
    several times cheaper on CPU than float32 noise.
    """
    xg = group_view(x, group_size)
    lo, hi = xg.amin(dim=1), xg.amax(dim=1)  # cheaper than aminmax(dim=1) on CPU
    exc_idx = torch.empty(0, dtype=torch.int64, device=x.device)
    exc_val = torch.empty(0, dtype=x.dtype, device=x.device)
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        xg, exc_idx, exc_val = fill_nonfinite_rows(xg)
        keep = exc_idx < x.numel()  # padding copies of a non-finite last value
        exc_idx, exc_val = exc_idx[keep], exc_val[keep].to(x.dtype)
        lo, hi = xg.amin(dim=1), xg.amax(dim=1)
    levels = float(2**bits - 1)
    zero_kept = (lo == 0) & (hi > 0) if bits > 1 else torch.zeros_like(lo, dtype=torch.bool)
    any_zero_kept = bool(zero_kept.any())
    if any_zero_kept:
        lo = torch.where(zero_kept, _min_positive_rows(xg), lo)
    top = torch.where(zero_kept, levels - 1, levels)
    step = (hi - lo) / top
    if not (torch.isfinite(step).all() and bool((1.0 / step[step > 0]).isfinite().all())):
        # ranges beyond float32, or denormal steps whose inverse overflows: use float64
        xg, lo, hi = xg.double(), lo.double(), hi.double()
        step = (hi - lo) / top
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    if noise is None:
        offset = (0.5 + 2.0**-17) - lo * inv
        t = torch.addcmul(offset[:, None], xg, inv[:, None])
        t.add_(noise16(xg.numel(), seed, x.device).view(xg.shape), alpha=2.0**-16)
    else:
        t = (xg - lo[:, None]) * inv[:, None]
        t.add_(noise)
    # floor(t + u) clamped to [0, top]: clamping first, truncation is the floor.
    if any_zero_kept:
        t.clamp_(min=0)
        torch.minimum(t, top[:, None].to(t.dtype), out=t)
    else:
        t.clamp_(0, levels)
    q = t.to(torch.uint8)
    if any_zero_kept:
        q += (xg != 0) & zero_kept[:, None]
    codes = pack_codes(q.view(-1), bits)
    scale = torch.where(zero_kept, -step, step).float()
    return {
        "codes": codes,
        "lo": lo.float() + 0.0,  # a zero minimum stored as +0.0, whatever the reduction gave
        "scale": scale,
        "exc_idx": exc_idx,
        "exc_val": exc_val,
    }


def quant_decode_ref(
    payload: dict[str, torch.Tensor],
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Flat tensor of ``numel`` decoded values in ``dtype``."""
    lo, scale = payload["lo"], payload["scale"]
    groups = lo.numel()
    q = unpack_codes(payload["codes"], bits, groups * group_size).view(groups, group_size)
    zero_kept = torch.signbit(scale)
    step = scale.abs()
    levels = float(2**bits - 1)
    if not torch.isfinite(lo + levels * step).all():
        lo, step = lo.double(), step.double()
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
    flat = out.view(-1)[:numel].to(dtype)
    return restore_exceptions(flat, payload["exc_idx"], payload["exc_val"])


def quant_encode(
    x: torch.Tensor, bits: int, group_size: int, seed: int, backend: str = "auto"
) -> dict[str, torch.Tensor]:
    """Encode through Triton or the torch reference (see :func:`use_triton`)."""
    if use_triton(x, backend):
        from lightning_acgc.kernels.quant_triton import quant_encode_triton

        return quant_encode_triton(x.contiguous(), bits, group_size, seed)
    return quant_encode_ref(x, bits, group_size, seed)


def quant_decode(
    payload: dict[str, torch.Tensor],
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode through Triton or the torch reference (see :func:`use_triton`)."""
    if use_triton(payload["lo"], backend):
        from lightning_acgc.kernels.quant_triton import quant_decode_triton

        return quant_decode_triton(payload, bits, group_size, numel, dtype)
    return quant_decode_ref(payload, bits, group_size, numel, dtype)
