"""Compiled CPU path of the ``intpack`` codec (``common/fastcpu.c``): the payload of
:mod:`lightning_acgc.kernels.intpack.reference`, byte for byte, in two passes (the
groups' minima and the widest residual; then the bit stream, parallel over blocks of
whole words) instead of a tensor of one byte per bit."""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.cpu_lib import cpu_library, cpu_threads

__all__ = ["intpack_decode_cpu", "intpack_encode_cpu"]


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
