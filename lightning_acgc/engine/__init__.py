"""The engine: saved-tensor hooks, sites and the byte meter. No Lightning import here."""

from lightning_acgc.engine.compressor import OOM_MESSAGE, ActivationCompressor, MemoryBudgetError
from lightning_acgc.engine.cycle import CalibrationCycle, exact_gradients, no_side_effects
from lightning_acgc.engine.meter import CompressionStats, SiteRecord
from lightning_acgc.engine.policy import Policy, Reduce
from lightning_acgc.engine.settings import EngineSettings
from lightning_acgc.engine.sites import ModuleTracker, SiteInfo
from lightning_acgc.engine.step import compressed_step

__all__ = [
    "OOM_MESSAGE",
    "ActivationCompressor",
    "CalibrationCycle",
    "CompressionStats",
    "EngineSettings",
    "MemoryBudgetError",
    "ModuleTracker",
    "Policy",
    "Reduce",
    "SiteInfo",
    "SiteRecord",
    "compressed_step",
    "exact_gradients",
    "no_side_effects",
]
