"""The engine: saved-tensor hooks, sites and the byte meter. No Lightning import here."""

from lightning_acgc.engine.api import compress_activations
from lightning_acgc.engine.compressor import OOM_MESSAGE, ActivationCompressor, MemoryBudgetError
from lightning_acgc.engine.meter import CompressionStats, SiteRecord
from lightning_acgc.engine.sites import ModuleTracker, SiteInfo
from lightning_acgc.engine.step import compressed_step, exact_gradients

__all__ = [
    "OOM_MESSAGE",
    "ActivationCompressor",
    "CompressionStats",
    "MemoryBudgetError",
    "ModuleTracker",
    "SiteInfo",
    "SiteRecord",
    "compress_activations",
    "compressed_step",
    "exact_gradients",
]
