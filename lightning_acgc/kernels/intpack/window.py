"""Pooling indices packed against the window each output reads — pure-torch reference.

A max-pool's saved indices are flat positions in an input plane of rows ``w_in`` long:
output ``(i, j)`` of stride ``s`` picks a position near ``s·i·w_in + s·j`` (its window's
corner). Frame of reference over groups of consecutive outputs still spans several input
rows (10-14 bits a value); against the corner, the row and column offsets inside the
window take 1-2 bits each.

Format of an integer tensor viewed as ``(P, h, w)`` (its last two dimensions; P the
product of the others), with ``s`` and ``w_in`` found by :func:`window_fit`:

* ``d = x − (s·i·w_in + s·j)`` modulo 2**64; the row offset ``rr = ⌊(d + ⌊w_in/2⌋) / w_in⌋``
  and the column offset ``rc = d − rr·w_in`` (so ``x = corner + rr·w_in + rc`` exactly,
  whatever ``rr``); every ``rr`` in [−2, 2] (a window of up to 5 rows).
* ``code = ((rr − min rr) << kb) | (rc − min rc)``, ``kb`` the bits of the column offsets'
  range; ``width`` the bits of the largest code (at most :data:`MAX_WIDTH`; wider, or a row
  offset outside [−2, 2], and the tensor takes plain ``intpack``).
* payload ``bits``: the codes as intpack's bit stream (code ``k`` at bits
  ``[k·width, (k + 1)·width)``); ``width``: uint8; ``window``: int64
  ``[s, w_in, min rr, min rc, kb, h, w]``.

The compiled CPU path (``window_encode_cpu`` in :mod:`lightning_acgc.kernels.intpack.cpu`)
writes the same bytes.
"""

from __future__ import annotations

import torch

from lightning_acgc.kernels.intpack.reference import pack_stream, unpack_stream

__all__ = [
    "MAX_WIDTH",
    "code_width",
    "window_candidates",
    "window_decode_ref",
    "window_encode_ref",
    "window_fit",
]

MAX_WIDTH = 8  # codes wider than this take plain intpack (a plane's rows: 10-14 bits)
SAMPLE_ROWS = 8  # rows of the first plane that choose (s, w_in)
_FITS: dict[tuple, tuple[int, int] | None] = {}  # (shape, dtype) -> its fit, memoized
MAX_ROW = 1 << 28  # input rows this long or longer take plain intpack
ROWS = (-2, 2)  # row offsets rr allowed (else plain intpack): windows of up to 5 rows


def window_candidates(w: int) -> list[tuple[int, int]]:
    """``(s, w_in)`` pairs for outputs ``w`` wide: strides 1-4, and the input widths that
    pooling with that stride maps to ``w`` columns (floor or ceil mode, any padding).

    Example:
        >>> window_candidates(3)[:4]
        [(1, 3), (2, 5), (2, 6), (2, 7)]
    """
    return [
        (s, w_in)
        for s in range(1, 5)
        for w_in in range(s * w - s + 1, s * w + s)
        if 1 <= w_in < MAX_ROW  # the C path's offsets are int32
    ]


def window_fit(x: torch.Tensor) -> tuple[int, int] | None:
    """The ``(s, w_in)`` of :func:`window_candidates` whose codes are narrowest on the first
    :data:`SAMPLE_ROWS` rows of ``x``'s first plane, if at most :data:`MAX_WIDTH` bits and
    narrower than plain intpack's residuals there (a constant tensor takes 0 bits plain);
    memoized per shape and dtype (a layer saves the same shape every step; the encode
    checks the whole tensor, so a fit is only ever a guess).

    Example:
        >>> _, idx = torch.nn.functional.max_pool2d(torch.randn(2, 3, 9, 9), 3, stride=2,
        ...                                         padding=1, return_indices=True)
        >>> window_fit(idx)
        (2, 9)
    """
    key = (tuple(x.shape), x.dtype)
    if key not in _FITS:
        if len(_FITS) > 256:
            _FITS.clear()
        h, w = x.shape[-2:]
        sample = x.reshape(-1, h, w)[:1, :SAMPLE_ROWS].to(torch.int64)
        # plain intpack's width on the sample (its groups of 256): a window must beat it
        flat = sample.reshape(-1)
        groups = flat[: max(flat.numel() // 256, 1) * 256].reshape(-1, min(flat.numel(), 256))
        spread = groups.amax(dim=1) - groups.amin(dim=1)
        best = min(MAX_WIDTH + 1, int(spread.max()).bit_length() if spread.min() >= 0 else 64)
        fit = None
        for s, w_in in window_candidates(w):
            rr, rc, ok = _offsets(sample, s, w_in)
            if not ok:
                continue
            width = code_width(int(rr.max() - rr.min()), int(rc.max() - rc.min()))[1]
            if width < best:
                best, fit = width, (s, w_in)
        _FITS[key] = fit
    return _FITS[key]


def _offsets(x: torch.Tensor, s: int, w_in: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(rr, rc) of the int64 ``(P, h, w)`` tensor ``x``; False where some row offset is
    outside ``ROWS`` (a window of up to 5 rows: the C path counts rr by comparisons)."""
    h, w = x.shape[-2:]
    i = torch.arange(h, device=x.device)[:, None]
    j = torch.arange(w, device=x.device)
    u = x - (s * w_in * i + s * j) + w_in // 2  # wraps modulo 2**64 like the C path's
    rr = torch.div(u, w_in, rounding_mode="floor")
    ok = bool(((rr >= ROWS[0]) & (rr <= ROWS[1])).all())
    return rr, u - w_in // 2 - rr * w_in, ok


def code_width(rr_range: int, rc_range: int) -> tuple[int, int]:
    """(kb, width) for offsets spanning ``rr_range`` and ``rc_range`` (max − min).

    Example:
        >>> code_width(1, 2)
        (2, 3)
    """
    kb = rc_range.bit_length()
    return kb, kb + rr_range.bit_length()


def window_encode_ref(x: torch.Tensor, s: int, w_in: int) -> dict[str, torch.Tensor] | None:
    """The window payload of a non-empty contiguous integer tensor of >= 3 dimensions,
    or None where the codes would be wider than :data:`MAX_WIDTH`.

    Example:
        >>> _, idx = torch.nn.functional.max_pool2d(torch.randn(1, 2, 8, 8), 2,
        ...                                         return_indices=True)
        >>> p = window_encode_ref(idx, 2, 8)
        >>> int(p["width"]), p["bits"].numel(), torch.equal(
        ...     window_decode_ref(p, idx.numel(), idx.dtype), idx.view(-1))
        (2, 8, True)
    """
    h, w = x.shape[-2:]
    v = x.reshape(-1, h, w).to(torch.int64)
    rr, rc, ok = _offsets(v, s, w_in)
    if not ok:
        return None
    mr, mc = int(rr.min()), int(rc.min())
    kb, width = code_width(int(rr.max()) - mr, int(rc.max()) - mc)
    if width > MAX_WIDTH:
        return None
    codes = (((rr - mr) << kb) | (rc - mc)).view(-1)
    window = torch.tensor([s, w_in, mr, mc, kb, h, w], dtype=torch.int64, device=x.device)
    return {
        "bits": pack_stream(codes, width),
        "width": torch.tensor(width, dtype=torch.uint8),
        "window": window,
    }


def window_decode_ref(
    payload: dict[str, torch.Tensor], numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """The flat tensor of the ``numel`` values in ``dtype`` (exact)."""
    s, w_in, mr, mc, kb, h, w = payload["window"].tolist()
    codes = unpack_stream(payload["bits"], int(payload["width"]), numel)
    rr = (codes >> kb) + mr
    rc = (codes & ((1 << kb) - 1)) + mc
    i = torch.arange(h, device=codes.device)[:, None]
    j = torch.arange(w, device=codes.device)
    corner = (s * w_in * i + s * j).view(-1).repeat(numel // (h * w))
    return (corner + rr * w_in + rc).to(dtype)
