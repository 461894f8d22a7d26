"""lightning_acgc: activation-compressed training for PyTorch and PyTorch Lightning."""

from lightning_acgc.codecs import Packed, available_codecs, build_codec
from lightning_acgc.config import CompressionConfig
from lightning_acgc.engine import ActivationCompressor, CompressionStats, compress_activations

__all__ = [
    "ActivationCompressor",
    "CompressionConfig",
    "CompressionStats",
    "Packed",
    "available_codecs",
    "build_codec",
    "compress_activations",
]
