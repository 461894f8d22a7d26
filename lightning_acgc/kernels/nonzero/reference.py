"""A floating tensor as a 1-bit mask of its non-zero elements plus their values — pure-torch
reference (the specification).

Format of a tensor ``x`` of ``n`` elements (flat, row-major; a 0-d tensor is one element):

* ``bits``: uint8, ``ceil(n / 8)`` bytes; bit ``i % 8`` of byte ``i // 8`` is set where
  element ``i`` has any bit set, the tail padded with zero bits (the ``mask`` family's
  layout, :mod:`lightning_acgc.kernels.mask.reference`). Elements are compared by bit
  pattern: ``+0.0`` alone is zero; ``-0.0``, NaN, ``±inf`` and denormals are non-zero.
* ``values``: 1-D, ``x.dtype``, the flagged elements in order, bit for bit (NaN payloads
  and signs kept).

Merging writes ``+0.0`` where a bit is clear and the values in order where it is set: the
bit-exact inverse. The compiled CPU path (``common/csrc/nonzero.c``) writes the same bytes.
"""

from __future__ import annotations

import torch

from lightning_acgc.kernels.mask.reference import mask_pack_ref, mask_unpack_ref

__all__ = ["check_merge_args", "nonzero_merge_ref", "nonzero_split_ref"]

# element size -> the integer dtype whose bit patterns are compared and copied
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (exact copies, NaN-safe compares)."""
    if t.is_complex() or t.element_size() not in _INT_OF_SIZE:
        raise TypeError(f"nonzero needs a real dtype of 1, 2, 4 or 8 bytes, got {t.dtype}")
    return t if t.dtype == torch.bool else t.view(_INT_OF_SIZE[t.element_size()])


def check_merge_args(
    bits: torch.Tensor, values: torch.Tensor, numel: int, out: torch.Tensor | None
) -> None:
    """Raise where ``bits``/``values``/``out`` cannot hold a split of ``numel`` elements.

    Raises:
        TypeError: ``bits`` not uint8, or ``out`` of another dtype than ``values``.
        ValueError: too few bytes, ``values`` not 1-D, or ``out`` not a contiguous tensor
            of ``numel`` elements.
    """
    if bits.dtype != torch.uint8:
        raise TypeError(f"bits must be uint8, got {bits.dtype}")
    if numel < 0 or bits.numel() * 8 < numel:
        raise ValueError(f"numel={numel} does not fit in {bits.numel()} bytes of bits")
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D, got shape {tuple(values.shape)}")
    if out is not None:
        if out.dtype != values.dtype:
            raise TypeError(f"out has dtype {out.dtype}, the values {values.dtype}")
        if out.numel() != numel or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous tensor of numel={numel} elements, got shape "
                f"{tuple(out.shape)} (contiguous: {out.is_contiguous()})"
            )


def nonzero_split_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits, values)`` of ``x`` (any shape, layout and real dtype).

    Example:
        >>> bits, values = nonzero_split_ref(torch.tensor([0.0, 2.0, -0.0, 0.0, 3.0]))
        >>> bits.tolist(), values.tolist()
        ([22], [2.0, -0.0, 3.0])
    """
    flat = x.reshape(-1)
    ints = _as_ints(flat)
    keep = ints != 0
    return mask_pack_ref(keep), ints[keep].view(x.dtype)


def nonzero_merge_ref(
    bits: torch.Tensor, values: torch.Tensor, numel: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The flat tensor of ``numel`` elements of ``values.dtype`` that ``bits`` and
    ``values`` were split from (into ``out`` when given).

    Raises:
        TypeError, ValueError: see :func:`check_merge_args`; ValueError also where the set
            bits and the values differ in number.

    Example:
        >>> nonzero_merge_ref(torch.tensor([22], dtype=torch.uint8),
        ...                   torch.tensor([2.0, -0.0, 3.0]), 5).tolist()
        [0.0, 2.0, -0.0, 0.0, 3.0]
    """
    check_merge_args(bits, values, numel, out)
    keep = mask_unpack_ref(bits.reshape(-1), numel)
    nnz = int(keep.sum())
    if nnz != values.numel():
        raise ValueError(f"{nnz} set bits among numel={numel}, but {values.numel()} values")
    if out is None:
        out = torch.empty(numel, dtype=values.dtype, device=values.device)
    ints = _as_ints(out.view(-1))
    ints.zero_()
    ints[keep] = _as_ints(values)
    return out
