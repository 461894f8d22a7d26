"""Lossless integer packing (frame of reference + bit packing) — pure-torch reference.

Format of a flat integer tensor of ``n`` values in groups of ``group_size`` (the tail
group is short):

* ``base``: int64 per group, the group's minimum.
* ``width``: int, the bits of the widest residual ``x - base`` over the whole tensor
  (0..64; residuals are taken modulo 2**64, so int64 extremes need 64 bits).
* ``bits``: uint8, residual ``i`` in bits ``[i * width, (i + 1) * width)`` of the stream,
  least significant bit first (bit ``j % 8`` of byte ``j // 8``).

Saved integer tensors (pooling indices, token indices, offsets, ``edge_index``) hold
values in narrow ranges per group, so they shrink from 64 bits to a few bits each.
"""

from __future__ import annotations

import torch

from lightning_acgc.kernels.common.bitpack import pack_codes, unpack_codes

__all__ = [
    "INT_DTYPES",
    "intpack_decode_ref",
    "intpack_encode_ref",
    "pack_stream",
    "unpack_stream",
]

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _groups(flat: torch.Tensor, group_size: int) -> torch.Tensor:
    """(G, group_size) int64 view of ``flat``, the tail padded with its last value."""
    pad = -flat.numel() % group_size
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.view(-1, group_size)


# Values per chunk of the bit (un)packing: its int64 temporaries hold values x width
# entries, so a chunk bounds them near 32 MB (unchunked, the 12.8M int64 max-pool
# indices of ResNet-50 at batch 64 took a 2.9 GB transient on a GPU).
_CHUNK_ENTRIES = 1 << 22


def _chunks(n: int, width: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges covering ``n`` values, each start a multiple of 8."""
    step = max(8, _CHUNK_ENTRIES // width // 8 * 8)
    return [(start, min(start + step, n)) for start in range(0, n, step)]


def pack_stream(r: torch.Tensor, width: int) -> torch.Tensor:
    """The low ``width`` bits (0..64) of each int64 in ``r`` as a bit stream (value ``i``
    at bits ``[i * width, (i + 1) * width)``, least significant bit first).

    Example:
        >>> pack_stream(torch.tensor([1, 2, 3]), 2).tolist()
        [57]
    """
    if width == 0:
        return torch.empty(0, dtype=torch.uint8, device=r.device)
    shifts = torch.arange(width, device=r.device)
    parts = []
    for start, stop in _chunks(r.numel(), width):
        stream = ((r[start:stop, None] >> shifts) & 1).to(torch.uint8).view(-1)
        pad = -stream.numel() % 8  # only the last chunk can end inside a byte
        if pad:
            stream = torch.cat([stream, stream.new_zeros(pad)])
        parts.append(pack_codes(stream, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def unpack_stream(bits: torch.Tensor, width: int, numel: int) -> torch.Tensor:
    """The ``numel`` int64 values of :func:`pack_stream`'s stream (bit 63 wraps to the
    sign: the inverse modulo 2**64)."""
    r = torch.zeros(numel, dtype=torch.int64, device=bits.device)
    if width == 0:
        return r
    shifts = torch.arange(width, device=bits.device)
    for start, stop in _chunks(numel, width):
        # chunks start at multiples of 8 values: on a byte boundary of the stream
        first, last = start * width // 8, -(-stop * width // 8)
        stream = unpack_codes(bits[first:last], 1, (stop - start) * width)
        stream = stream.view(stop - start, width).to(torch.int64)
        torch.sum(stream << shifts, dim=1, out=r[start:stop])  # bit 63: -2**63 wraps
    return r


def intpack_encode_ref(x: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Pack a non-empty integer tensor of a dtype in :data:`INT_DTYPES`.

    Example:
        >>> p = intpack_encode_ref(torch.tensor([7, 8, 9, 10]), group_size=4)
        >>> p["base"].tolist(), int(p["width"]), p["bits"].numel()
        ([7], 2, 1)
    """
    flat = x.reshape(-1).to(torch.int64)
    n = flat.numel()
    g = _groups(flat, group_size)
    base = g.amin(dim=1)
    r = (g - base[:, None]).view(-1)[:n]  # wraps modulo 2**64 for int64 extremes
    width = 64 if bool((r < 0).any()) else int(r.max()).bit_length()
    bits = pack_stream(r, width)
    return {"base": base, "width": torch.tensor(width, dtype=torch.uint8), "bits": bits}


def intpack_decode_ref(
    payload: dict[str, torch.Tensor], group_size: int, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """Flat tensor of the ``numel`` packed values in ``dtype`` (exact)."""
    base = payload["base"]
    r = unpack_stream(payload["bits"].to(base.device), int(payload["width"]), numel)
    out = r + base.repeat_interleave(group_size)[:numel]
    return out.to(dtype)
