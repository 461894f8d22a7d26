"""Data modules of the recipes: an offline default and a real loader per data kind."""

from recipes.data.availability import DataUnavailableError
from recipes.data.graph import CoraDataModule, SBMGraphDataModule
from recipes.data.pytext import PyDocTextDataModule
from recipes.data.text import GlueDataModule, SyntheticTextDataModule
from recipes.data.vision import CIFAR10DataModule, DigitsDataModule

__all__ = [
    "CIFAR10DataModule",
    "CoraDataModule",
    "DataUnavailableError",
    "DigitsDataModule",
    "GlueDataModule",
    "PyDocTextDataModule",
    "SBMGraphDataModule",
    "SyntheticTextDataModule",
]
