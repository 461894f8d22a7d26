"""Byte accounting of saved activations: raw bytes of distinct storages vs bytes kept."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompressionStats", "SiteRecord"]


@dataclass
class SiteRecord:
    """What happened at one site (summed over the saves counted by the meter)."""

    key: str
    module: str
    module_type: str
    shape: tuple[int, ...]
    dtype: str
    codec: str
    settings: str
    raw_bytes: int = 0
    packed_bytes: int = 0
    count: int = 0
    shared_with: str | None = None  # the site that packed this same tensor first

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.packed_bytes if self.packed_bytes else 1.0


@dataclass
class CompressionStats:
    """Counters of one :func:`compress_activations` scope (or one training step).

    ``saved_bytes`` counts each distinct storage of a saved activation once (what plain
    autograd would keep alive); ``packed_bytes`` counts what is kept instead: payload
    and metadata of packed tensors, plus tensors kept as they are. Parameters and
    buffers are in neither: they are resident anyway.
    """

    saved_bytes: int = 0
    packed_bytes: int = 0
    tensors_packed: int = 0
    tensors_kept: int = 0
    live_bytes: int = 0
    peak_live_bytes: int = 0
    sites: dict[str, SiteRecord] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """``saved_bytes / packed_bytes`` (1.0 when nothing was saved)."""
        return self.saved_bytes / self.packed_bytes if self.packed_bytes else 1.0

    def reset(self) -> None:
        """Zero the counters of a new step; live bytes still held stay counted."""
        self.saved_bytes = self.packed_bytes = 0
        self.tensors_packed = self.tensors_kept = 0
        self.peak_live_bytes = self.live_bytes
        self.sites = {}

    def add_live(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def table(self) -> str:
        """A per-site text table: module, shape, codec, settings, MB before -> after."""
        head = (
            f"{'site':<40} {'shape':<22} {'codec':<9} {'settings':<22} "
            f"{'MB before':>10} {'MB after':>10} {'ratio':>7}"
        )
        lines = [head, "-" * len(head)]
        for rec in self.sites.values():
            lines.append(
                f"{rec.key[-40:]:<40} {str(list(rec.shape))[:22]:<22} {rec.codec:<9} "
                f"{rec.settings[:22]:<22} {rec.raw_bytes / 2**20:>10.3f} "
                f"{rec.packed_bytes / 2**20:>10.3f} {rec.ratio:>7.2f}"
            )
        lines.append(
            f"{'total':<40} {'':<22} {'':<9} {'':<22} {self.saved_bytes / 2**20:>10.3f} "
            f"{self.packed_bytes / 2**20:>10.3f} {self.ratio:>7.2f}"
        )
        return "\n".join(lines)
