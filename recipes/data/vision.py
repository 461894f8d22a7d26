"""Image data: scikit-learn's bundled digits (offline default) and CIFAR-10 (torchvision)."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from recipes.data.availability import data_root, fall_back_or_raise, network_problem
from recipes.data.base import SplitDataModule, split_indices

__all__ = ["CIFAR10DataModule", "DigitsDataModule", "digits_splits", "load_digits"]

_CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR_STD = (0.2470, 0.2435, 0.2616)


def load_digits(image_size: int = 32, in_channels: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 bundled 8x8 handwritten digits, upscaled (bilinear).

    Real data shipped inside scikit-learn: nothing is downloaded.

    Args:
        image_size: side of the returned square images.
        in_channels: 1, or 3 (the grey channel repeated, for RGB models).

    Returns:
        Images ``(1797, in_channels, image_size, image_size)`` in [0, 1] and labels 0-9.

    Example:
        >>> x, y = load_digits(16)
        >>> tuple(x.shape), int(y.max())
        ((1797, 1, 16, 16), 9)
    """
    from sklearn.datasets import load_digits as _sk_load_digits

    bunch = _sk_load_digits()
    x = torch.as_tensor(bunch.images, dtype=torch.float32)[:, None] / 16.0
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = x.clamp_(0, 1).expand(-1, in_channels, -1, -1).contiguous()
    return x, torch.as_tensor(bunch.target)


def digits_splits(
    image_size: int, in_channels: int, val_fraction: float, seed: int
) -> tuple[TensorDataset, TensorDataset]:
    """Training and validation sets of :func:`load_digits`, standardised with the
    training split's mean and standard deviation."""
    x, y = load_digits(image_size, in_channels)
    train_idx, val_idx = split_indices(len(y), val_fraction, seed)
    x = (x - x[train_idx].mean()) / x[train_idx].std()
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[val_idx], y[val_idx])


class DigitsDataModule(SplitDataModule):
    """scikit-learn's bundled 8x8 digits upscaled to ``image_size`` — real data, offline.

    1,797 images, 10 classes; a seeded train/val split; standardised with the training
    split's mean and standard deviation.

    Args:
        batch_size: training batch size.
        val_fraction: share of the images held out for validation.
        image_size: side of the upscaled images (32 suits CIFAR-style ResNets).
        in_channels: 1 (grey) or 3 (grey repeated, for RGB models).
        num_classes: must be 10 (checked; the model config reads it).
        num_workers: data loader worker processes.
        seed: seed of the split and of the shuffling.

    Raises:
        ValueError: a bad fraction, channel count, size or class count.

    Example:
        >>> dm = DigitsDataModule(batch_size=32, image_size=16)
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> tuple(x.shape)
        (32, 1, 16, 16)
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        image_size: int = 32,
        in_channels: int = 1,
        num_classes: int = 10,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        split_indices(2, val_fraction, seed)  # checks the fraction now
        if in_channels not in (1, 3):
            raise ValueError(f"in_channels={in_channels!r} must be 1 or 3")
        if image_size < 8:
            raise ValueError(f"image_size={image_size!r} must be >= 8 (the digits are 8x8)")
        if num_classes != 10:
            raise ValueError(f"num_classes={num_classes!r}: the digits have 10 classes")
        self.val_fraction = val_fraction
        self.image_size = image_size
        self.in_channels = in_channels

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = digits_splits(
                self.image_size, self.in_channels, self.val_fraction, self.seed
            )
            self.source = f"digits (scikit-learn, 8x8 -> {self.image_size}x{self.image_size})"


class CIFAR10DataModule(SplitDataModule):
    """CIFAR-10 through ``torchvision`` (downloaded once into ``root``).

    Where ``torchvision`` is missing or the files cannot be had (no copy in ``root``
    and the host unreachable within ``timeout_s``), it falls back to the offline
    default — digits, 3 channels, 32x32 — with a warning, or raises if ``fallback``
    is false.

    Args:
        root: directory of the data set files (``~`` is expanded).
        batch_size: training batch size.
        augment: random crop (padding 4) and horizontal flip on training images.
        download: download into ``root`` when the files are missing.
        fallback: train on the offline default when CIFAR-10 is not available.
        timeout_s: seconds allowed for the network probe.
        image_size: must be 32 (checked; the model config reads it).
        in_channels: must be 3 (checked; the model config reads it).
        num_classes: must be 10 (checked; the model config reads it).
        num_workers: data loader worker processes.
        seed: seed of the shuffling (and of the fallback's split).

    Raises:
        ValueError: a size, channel or class count that CIFAR-10 does not have.
        DataUnavailableError: CIFAR-10 is not available and ``fallback`` is false.
    """

    def __init__(
        self,
        root: str = "~/.cache/lightning_acgc/data",
        batch_size: int = 128,
        augment: bool = True,
        download: bool = True,
        fallback: bool = True,
        timeout_s: float = 3.0,
        image_size: int = 32,
        in_channels: int = 3,
        num_classes: int = 10,
        num_workers: int = 2,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        for name, value, want in (
            ("image_size", image_size, 32),
            ("in_channels", in_channels, 3),
            ("num_classes", num_classes, 10),
        ):
            if value != want:
                raise ValueError(f"{name}={value!r}: CIFAR-10 has {name}={want}")
        self.root = root
        self.augment = augment
        self.download = download
        self.fallback = fallback
        self.timeout_s = timeout_s
        self._problem: str | None = None  # why prepare_data could not download

    def _torchvision_sets(self, download: bool) -> tuple[Any, Any]:
        import torchvision
        from torchvision import transforms as T

        norm = [T.ToTensor(), T.Normalize(_CIFAR_MEAN, _CIFAR_STD)]
        aug = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if self.augment else []
        root = data_root(self.root)
        cifar = torchvision.datasets.CIFAR10
        train = cifar(root, train=True, download=download, transform=T.Compose(aug + norm))
        val = cifar(root, train=False, download=download, transform=T.Compose(norm))
        return train, val

    def prepare_data(self) -> None:
        if importlib.util.find_spec("torchvision") is None or not self.download:
            return
        try:
            self._torchvision_sets(download=False)
        except RuntimeError:  # not downloaded yet
            self._problem = network_problem("www.cs.toronto.edu", timeout_s=self.timeout_s)
            if self._problem is None:
                try:
                    self._torchvision_sets(download=True)
                except (OSError, RuntimeError) as err:
                    self._problem = f"the download failed: {type(err).__name__}: {err}"

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if importlib.util.find_spec("torchvision") is None:
            reason = "torchvision is not installed (pip install torchvision)"
        else:
            try:
                self.train_set, self.val_set = self._torchvision_sets(download=False)
                self.source = "CIFAR-10 (torchvision)"
                return
            except RuntimeError:
                why = self._problem or (
                    "download=false" if not self.download else "prepare_data() was not run"
                )
                reason = f"no copy in {self.root}, and no download: {why}"
        fall_back_or_raise("CIFAR-10", reason, "data=digits", self.fallback)
        self.train_set, self.val_set = digits_splits(32, 3, val_fraction=0.2, seed=self.seed)
        self.source = "digits (scikit-learn, 8x8 -> 32x32, 3 channels) [fallback for CIFAR-10]"
