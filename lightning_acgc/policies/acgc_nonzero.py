"""acgc's choice of layout for tensors of many zeros: ``quant`` or ``nonzero``.

A tensor whose share of non-zero values is at most :data:`NONZERO_MAX_SHARE` (a ReLU
output: about half) is stored by the ``nonzero`` codec at every width acgc gives it: a
mask bit per value, and the width for its non-zero values only. Its variance table is
measured on those values as the codec groups them (packed together), times their share:
the mean per-element variance of the whole tensor, zeros exact. Its cost per value is
``1 + share·(width + metadata)``
(:func:`~lightning_acgc.policies.bit_allocation.width_cost`), which the allocations read,
so a sparse tensor also gets the cheaper bits. At a share of 2/3 the mask costs what the
zeros' codes saved at 4 bits; below it, every width from 3 bits up is cheaper, and the
zeros are exact even at 1 bit (``quant`` at 1 bit cannot keep them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.quant import QuantWidthConfig
from lightning_acgc.kernels import nonzero as nk
from lightning_acgc.kernels.quant import stored_meta
from lightning_acgc.policies.bit_allocation import LADDER
from lightning_acgc.policies.quant_error import sr_variance

__all__ = ["NONZERO_MAX_SHARE", "NonzeroLayout", "rounding_table"]

NONZERO_MAX_SHARE = 2 / 3


def rounding_table(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean per-element rounding variance of ``x`` at each width of ``LADDER`` in the
    layout acgc will store it in, followed by ``x``'s share of non-zero values (float64,
    ``len(LADDER) + 1`` entries).

    Example:
        >>> x = torch.randn(4096).relu()
        >>> t = rounding_table(x, 256)
        >>> share = float(t[-1])
        >>> 0.4 < share < 0.6, bool(torch.isfinite(t[0]))  # 1 bit: zeros kept by the mask
        (True, True)
    """
    x = x.detach()
    if x.numel() == 0:
        return torch.cat([sr_variance(x, group_size), x.new_ones(1, dtype=torch.float64)])
    _, values = nk.nonzero_split(x)
    share = values.numel() / x.numel()
    if share > NONZERO_MAX_SHARE:
        table = sr_variance(x, group_size)
    elif values.numel():
        table = sr_variance(values, group_size) * share
    else:  # every value zero: the mask alone, no error at any width
        table = torch.zeros_like(sr_variance(x, group_size))
    return torch.cat([table, table.new_tensor([share])])


class NonzeroLayout:
    """Mixin of :class:`~lightning_acgc.policies.acgc.ACGCPolicy`: ``_nonzero`` (site key →
    share of non-zero values, from the calibrations) and the ``quant``-family codec of a
    width. Uses ``group_size``, ``_meta`` and ``_codec``."""

    _nonzero: dict[str, float]
    _variances: dict[str, list[float]]
    group_size: int
    _meta: dict[str, Any]
    _codec: Callable[..., Codec]

    def store_tables(self, flat: dict[str, float], keys: Iterable[str]) -> None:
        """A calibration's :func:`rounding_table` of each tensor in ``keys``, flattened
        (``flat[f"{key}\\0{i}"]``, averaged over ranks), as its variance per width and
        share of non-zero values. (Non-finite values count as zeros in the variances, so
        a tensor holding ±inf leaves no trace; an infinite entry means a width never to
        choose: 1 bit where a group's zeros must stay exact.)"""
        for key in keys:
            table = [flat[f"{key}\0{i}"] for i in range(len(LADDER) + 1)]
            self._variances[key], self._nonzero[key] = table[:-1], table[-1]

    def nonzero_shares(self) -> dict[str, float]:
        """Share of non-zero values of every tensor stored by the ``nonzero`` codec."""
        return {k: s for k, s in self._nonzero.items() if s <= NONZERO_MAX_SHARE}

    def quant_codec(self, key: str, bits: int, low_share: float = 0.0) -> Codec:
        """The codec of tensor ``key`` at ``bits`` (``low_share`` of its values a bit
        narrower): ``nonzero`` for a tensor of many zeros, else ``split`` or ``quant``."""
        options = {"bits": bits, "group_size": self.group_size, **self._meta}
        if self._nonzero.get(key, 1.0) <= NONZERO_MAX_SHARE:
            return self._codec("nonzero", low_share=low_share, **options)
        if low_share:
            return self._codec("split", low_share=low_share, **options)
        return self._codec("quant", QuantWidthConfig, **options)

    def _group_meta_bits(self, device_type: str) -> int:
        """Bits of one group's metadata as the quant kernels write it on that device."""
        meta = self._meta.get("meta", "fp32")
        return 32 if stored_meta(meta, device_type, self.config.backend) == "bf16" else 64
