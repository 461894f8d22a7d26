"""Compiled CPU path of the ``intpack`` codec (``common/csrc/intpack.c``): the payload of
:mod:`lightning_acgc.kernels.intpack.reference`, byte for byte, in two passes (the
groups' minima and the widest residual; then the bit stream, parallel over blocks of
whole words) instead of a tensor of one byte per bit; and the window mode of
:mod:`lightning_acgc.kernels.intpack.window` (the offsets' ranges, then the codes)."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads
from lightning_acgc.kernels.common.small import cpu_scalar, cpu_values
from lightning_acgc.kernels.intpack.window import MAX_WIDTH, code_width

__all__ = ["intpack_decode_cpu", "intpack_encode_cpu", "window_decode_cpu", "window_encode_cpu"]


def intpack_encode_cpu(x: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Pack a non-empty CPU integer tensor; the payload of ``intpack_encode_ref``."""
    flat = x.reshape(-1).to(torch.int64).contiguous()
    n = flat.numel()
    lib, threads = cpu_library(), cpu_threads()
    base = torch.empty(-(-n // group_size), dtype=torch.int64)
    top = lib.acgc_intpack_base(flat.data_ptr(), n, group_size, base.data_ptr(), threads)
    width = 64 if top >= 2**63 else int(top).bit_length()
    bits = torch.empty((n * width + 7) // 8, dtype=torch.uint8)
    if width:
        lib.acgc_intpack_pack(
            flat.data_ptr(), n, group_size, base.data_ptr(), width, bits.data_ptr(), threads
        )
    return {"base": base, "width": torch.tensor(width, dtype=torch.uint8), "bits": bits}


def intpack_decode_cpu(
    payload: dict[str, torch.Tensor], group_size: int, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """Flat tensor of the ``numel`` packed values in ``dtype`` (exact)."""
    base = payload["base"].contiguous()
    width = int(payload["width"])
    bits = payload["bits"].contiguous()
    if base.numel() != -(-numel // group_size) or bits.numel() != (numel * width + 7) // 8:
        raise ValueError(
            f"numel={numel} does not match a payload of {base.numel()} groups of "
            f"{group_size} and {bits.numel()} bytes at width {width}"
        )
    out = torch.empty(numel, dtype=torch.int64)
    if numel:
        cpu_library().acgc_intpack_unpack(
            bits.data_ptr(), numel, group_size, base.data_ptr(), width, out.data_ptr(),
            cpu_threads(),
        )  # fmt: skip
    return out if dtype == torch.int64 else out.to(dtype)


# (shape, dtype, s, w_in) -> the code parameters (min rr, min rc, kb, width) of the last
# tensor packed: a layer saves indices of one shape every step, and their ranges rarely change
_LAST: dict[tuple, tuple[int, int, int, int]] = {}


def window_encode_cpu(x: torch.Tensor, s: int, w_in: int) -> dict[str, torch.Tensor] | None:
    """The payload of ``window_encode_ref``, byte for byte (None where it declines): packed
    with the last tensor of this shape's code parameters, which one pass checks against
    the tensor's own ranges; packed again only where they differ (or for a first tensor,
    whose pass at width 0 finds its ranges)."""
    h, w = x.shape[-2:]
    flat = x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()
    n, data = flat.numel(), flat.data_ptr()
    lib, threads = cpu_library(), cpu_threads()
    ranges = torch.empty(4, dtype=torch.int64)

    def pack(mr: int, mc: int, kb: int, width: int) -> tuple[torch.Tensor, bool]:
        bits = torch.empty((n * width + 7) // 8, dtype=torch.uint8)
        ptrs = (bits.data_ptr(), ranges.data_ptr(), threads)
        return bits, bool(lib.acgc_window_pack(data, n, h, w, s, w_in, mr, mc, kb, width, *ptrs))

    key = (x.shape, x.dtype, s, w_in)
    guess = _LAST.get(key, (0, 0, 0, 0))
    bits, inside = pack(*guess)
    if not inside:
        return None
    mr, top_r, mc, top_c = ranges.tolist()
    kb, width = code_width(top_r - mr, top_c - mc)
    if width > MAX_WIDTH:
        return None
    if (mr, mc, kb, width) != guess:
        bits, _ = pack(mr, mc, kb, width)
        if len(_LAST) > 256:
            _LAST.clear()
        _LAST[key] = (mr, mc, kb, width)
    window = cpu_values((s, w_in, mr, mc, kb, h, w), torch.int64)
    return {"bits": bits, "width": cpu_scalar(width, torch.uint8), "window": window}


def window_decode_cpu(
    payload: dict[str, torch.Tensor], numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """The flat tensor of the ``numel`` values in ``dtype`` (exact)."""
    s, w_in, mr, mc, kb, h, w = payload["window"].tolist()
    width = int(payload["width"])
    bits = payload["bits"].contiguous()
    if bits.numel() != (numel * width + 7) // 8:
        raise ValueError(f"numel={numel} does not match {bits.numel()} bytes at width {width}")
    out = torch.empty(numel, dtype=torch.int64)
    if numel:
        cpu_library().acgc_window_unpack(
            bits.data_ptr(), numel, h, w, s, w_in, mr, mc, kb, width, out.data_ptr(),
            cpu_threads(),
        )  # fmt: skip
    return out if dtype == torch.int64 else out.to(dtype)
