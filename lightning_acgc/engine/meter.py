"""Byte accounting of saved activations: raw bytes of distinct storages vs bytes kept."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LOSS_HALF", "RAW_CODECS", "CompressionStats", "SiteRecord"]

# Site codecs under which the tensor itself is held (its storage charged once).
RAW_CODECS = ("kept", "identity")
LOSS_HALF = "loss, float16"  # the settings of the loss's tensors the engine stores as float16


@dataclass
class SiteRecord:
    """What happened at one site (summed over the saves counted by the meter).

    ``raw_bytes`` are the bytes of the storages this site was the first to save (they
    sum to :attr:`CompressionStats.saved_bytes`); ``tensor_bytes`` are the bytes of the
    tensors it packed or kept itself, so :attr:`ratio` is what the codec achieved on
    them. The two differ for a slice of a larger storage: plain autograd keeps the whole
    storage alive for it.
    """

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
    tensor_bytes: int = 0
    derived_from: str | None = None  # remade at unpack from this site's tensor (f(x))
    gain: float = 1.0  # derived: x's rounding variance -> this tensor's (mean f'(x)²)
    # derived from more than one stored tensor (a residual sum): the others, with gains
    also_from: tuple[tuple[str, float], ...] = ()

    @property
    def ratio(self) -> float:
        """The codec's ratio on this site's tensors (1.0 for tensors kept raw)."""
        if self.codec in RAW_CODECS or not self.packed_bytes:
            return 1.0
        return self.tensor_bytes / self.packed_bytes


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
        """``saved_bytes / packed_bytes`` (1.0 when nothing was saved): the memory held
        by plain autograd over the memory held instead."""
        return self.saved_bytes / self.packed_bytes if self.packed_bytes else 1.0

    @property
    def codec_ratio(self) -> float:
        """Bytes of the tensors taken over bytes held for them: at most what the codecs
        can give (it leaves out the rest of storages of which only a slice was saved,
        which :attr:`ratio` counts)."""
        tensors = sum(
            r.packed_bytes if r.codec in RAW_CODECS else r.tensor_bytes for r in self.sites.values()
        )
        return tensors / self.packed_bytes if self.packed_bytes else 1.0

    def reset(self) -> None:
        """Zero the counters of a new step; live bytes still held stay counted."""
        self.saved_bytes = self.packed_bytes = 0
        self.tensors_packed = self.tensors_kept = 0
        self.peak_live_bytes = self.live_bytes
        self.sites = {}

    def add_live(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def table(self, full: bool = False, top: int = 10) -> str:
        """A per-site text table: module, shape, codec, settings, MB before -> after.

        Args:
            full: every site, in order of appearance; otherwise the ``top`` largest
                sites by bytes before, a line counting the rest, one line naming why
                tensors stayed raw (``kept``: parameter-free reasons such as
                ``not float``, ``tiny``, ``bool``, ``<codec> not smaller``), and the total.
            top: sites shown by the short table.
        """
        head = (
            f"{'site':<40} {'shape':<22} {'codec':<9} {'settings':<22} "
            f"{'MB before':>10} {'MB after':>10} {'ratio':>7}"
        )
        lines = [head, "-" * len(head)]
        records = list(self.sites.values())
        if not full:
            records = sorted(records, key=lambda r: r.raw_bytes, reverse=True)[:top]
        for rec in records:
            lines.append(
                f"{rec.key[-40:]:<40} {str(list(rec.shape))[:22]:<22} {rec.codec:<9} "
                f"{rec.settings[:22]:<22} {rec.raw_bytes / 2**20:>10.3f} "
                f"{rec.packed_bytes / 2**20:>10.3f} {rec.ratio:>7.2f}"
            )
        hidden = len(self.sites) - len(records)
        if hidden:
            lines.append(f"... {hidden} smaller sites (print_table='full' lists every site)")
        kept: dict[str, list[int]] = {}
        for rec in self.sites.values():
            if rec.codec == "kept":
                entry = kept.setdefault(rec.settings, [0, 0])
                entry[0] += 1
                entry[1] += rec.raw_bytes
        if kept:
            lines.append(
                "kept raw: "
                + ", ".join(
                    f"{why} ({n} sites, {nbytes / 2**20:.3f} MB)"
                    for why, (n, nbytes) in sorted(kept.items(), key=lambda kv: -kv[1][1])
                )
            )
        lines.append(
            "ratio: per site, the codec's (tensors / packed); total, the memory's (distinct "
            f"storages plain autograd would hold / bytes held; codec ratio {self.codec_ratio:.2f})"
        )
        lines.append(
            f"{'total':<40} {'':<22} {'':<9} {'':<22} {self.saved_bytes / 2**20:>10.3f} "
            f"{self.packed_bytes / 2**20:>10.3f} {self.ratio:>7.2f}"
        )
        return "\n".join(lines)
