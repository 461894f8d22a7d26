"""``SplitDataModule``: a train and a validation set with seeded shuffling."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["SplitDataModule", "split_indices"]


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random split of ``range(n)`` into training and validation indices.

    Raises:
        ValueError: ``val_fraction`` outside (0, 1).

    Example:
        >>> train, val = split_indices(10, 0.2, seed=0)
        >>> len(train), len(val)
        (8, 2)
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction!r} must be in (0, 1)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = round(n * val_fraction)
    return perm[n_val:], perm[:n_val]


class SplitDataModule(pl.LightningDataModule):
    """Loaders over ``train_set`` and ``val_set``, which subclasses fill in ``setup``.

    Args:
        batch_size: training batch size (validation uses at least this); a last
            incomplete training batch is dropped, so every step sees ``batch_size``.
        num_workers: data loader worker processes.
        seed: seed of the training shuffle (the same order on every run).

    Attributes:
        source: what the data actually is, for the run's summary line (it names the
            fallback when a real data set was not available).
    """

    def __init__(self, batch_size: int, num_workers: int, seed: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.source = ""

    def _ready(self, dataset: Dataset | None) -> Dataset:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__} is not set up: call setup('fit') first")
        return dataset

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self._ready(self.train_set),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=len(self._ready(self.train_set)) > self.batch_size,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self._ready(self.val_set),
            batch_size=max(self.batch_size, 256),
            num_workers=self.num_workers,
        )
