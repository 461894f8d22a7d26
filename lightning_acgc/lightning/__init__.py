"""The Lightning adapter: the callback (hooks only), the calibration driver that owns a
fit's compression state, the compression strategies (registered with Lightning's
``StrategyRegistry`` on import) and the compressed batch-size search. It calls the
engine's one calibration cycle (:class:`lightning_acgc.engine.CalibrationCycle`)."""

from lightning_acgc.lightning.batch_size import CompressedBatchSizeFinder
from lightning_acgc.lightning.callback import ActivationCompression
from lightning_acgc.lightning.driver import CalibrationDriver
from lightning_acgc.lightning.options import CODEC_POLICY, DEFAULT_POLICY, DEFAULT_POLICY_OPTIONS
from lightning_acgc.lightning.strategy import (
    ACGCDDPStrategy,
    ACGCFSDPStrategy,
    ACGCStrategy,
    register_acgc_strategies,
)

__all__ = [
    "CODEC_POLICY",
    "DEFAULT_POLICY",
    "DEFAULT_POLICY_OPTIONS",
    "ACGCDDPStrategy",
    "ACGCFSDPStrategy",
    "ACGCStrategy",
    "ActivationCompression",
    "CalibrationDriver",
    "CompressedBatchSizeFinder",
    "register_acgc_strategies",
]
