"""lightning_acgc: activation-compressed training for PyTorch and PyTorch Lightning."""

from lightning_acgc.api import compress_activations
from lightning_acgc.checkpointing import CheckpointedModules
from lightning_acgc.codecs import CodecSpec, Packed, available_codecs, build_codec
from lightning_acgc.engine import (
    ActivationCompressor,
    CompressionStats,
    EngineSettings,
    compressed_step,
)
from lightning_acgc.lightning import (
    ACGCDDPStrategy,
    ACGCFSDPStrategy,
    ACGCStrategy,
    ActivationCompression,
    CompressedBatchSizeFinder,
)
from lightning_acgc.policies import available_policies, build_policy

__all__ = [
    "ACGCDDPStrategy",
    "ACGCFSDPStrategy",
    "ACGCStrategy",
    "ActivationCompression",
    "ActivationCompressor",
    "CheckpointedModules",
    "CodecSpec",
    "CompressedBatchSizeFinder",
    "CompressionStats",
    "EngineSettings",
    "Packed",
    "available_codecs",
    "available_policies",
    "build_codec",
    "build_policy",
    "compress_activations",
    "compressed_step",
]
