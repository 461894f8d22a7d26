"""``intpack`` kernels: lossless frame-of-reference bit packing of integer tensors
(pure torch; see :mod:`lightning_acgc.kernels.intpack.reference`)."""

from lightning_acgc.kernels.intpack.reference import (
    INT_DTYPES,
    intpack_decode_ref,
    intpack_encode_ref,
)

__all__ = ["INT_DTYPES", "intpack_decode_ref", "intpack_encode_ref"]
