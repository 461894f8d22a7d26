"""CPU path of the ``division`` codec: the reference's pooling in torch with the compiled
quant and mask kernels (:mod:`lightning_acgc.kernels.quant.cpu`,
:mod:`lightning_acgc.kernels.mask.cpu`); the same payload as the reference."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_acgc.kernels.division.reference import (
    Kernels,
    division_decode_with,
    division_encode_with,
)
from lightning_acgc.kernels.mask.cpu import mask_pack_cpu, mask_unpack_cpu
from lightning_acgc.kernels.quant.cpu import quant_decode_cpu, quant_encode_cpu

__all__ = ["division_decode_cpu", "division_encode_cpu"]

CPU_KERNELS = Kernels(quant_encode_cpu, quant_decode_cpu, mask_pack_cpu, mask_unpack_cpu)


def division_encode_cpu(
    x: torch.Tensor,
    block: int,
    residual_bits: int,
    group_size: int,
    low_dtype: torch.dtype,
    seed: int,
) -> dict[str, torch.Tensor]:
    """Encode a non-empty CPU floating tensor (payload of ``division_encode_ref``)."""
    return division_encode_with(CPU_KERNELS, x, block, residual_bits, group_size, low_dtype, seed)


def division_decode_cpu(
    payload: dict[str, torch.Tensor],
    shape: Sequence[int],
    dtype: torch.dtype,
    block: int,
    residual_bits: int,
    group_size: int,
) -> torch.Tensor:
    """Decode a payload (of any path) on the CPU."""
    args = (payload, shape, dtype, block, residual_bits, group_size)
    return division_decode_with(CPU_KERNELS, *args)
