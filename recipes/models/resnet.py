"""ResNet in plain torch (ResNet-18/34/50/101 layouts) and its LightningModule."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from recipes.models.classifier import Classifier

__all__ = ["LAYOUTS", "BasicBlock", "Bottleneck", "ResNet", "ResNetClassifier"]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion: ClassVar[int] = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        self.shortcut = _shortcut(in_planes, out, stride)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand x4, residual connection (ResNet-50/101)."""

    expansion: ClassVar[int] = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        self.shortcut = _shortcut(in_planes, out, stride)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


def _shortcut(in_planes: int, out: int, stride: int) -> nn.Module:
    if stride == 1 and in_planes == out:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_planes, out, 1, stride, bias=False), nn.BatchNorm2d(out))


# depth -> (block type, blocks per stage)
LAYOUTS: dict[int, tuple[type[nn.Module], tuple[int, int, int, int]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
}


class ResNet(nn.Module):
    """ResNet (He et al. 2016) with a width multiplier and an optional CIFAR-style stem.

    Args:
        depth: 18, 34 (BasicBlock) or 50, 101 (Bottleneck).
        num_classes: outputs of the final linear layer.
        in_channels: channels of the input images.
        width: multiplier of the stage widths 64, 128, 256, 512 (``0.125`` gives
            8, 16, 32, 64: tiny models for tests).
        cifar_stem: a 3x3 stride-1 convolution and no max-pool (for 32x32 images);
            ``False``: the ImageNet stem, 7x7 stride-2 convolution and 3x3 max-pool.
        zero_init_residual: start each residual branch's last BatchNorm at zero, so
            every block starts as the identity.

    Raises:
        ValueError: an unknown depth or a width that leaves a stage without channels.

    Example:
        >>> net = ResNet(depth=18, num_classes=10, in_channels=1, width=0.125)
        >>> net(torch.randn(2, 1, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        depth: int = 18,
        num_classes: int = 10,
        in_channels: int = 3,
        width: float = 1.0,
        cifar_stem: bool = True,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        if depth not in LAYOUTS:
            raise ValueError(f"depth={depth!r} is unknown; allowed values: {sorted(LAYOUTS)}")
        if not width > 0 or round(64 * width) < 1:
            raise ValueError(f"width={width!r} must be >= 1/64 (the first stage needs a channel)")
        block, counts = LAYOUTS[depth]
        planes = [max(1, round(64 * width * 2**i)) for i in range(4)]
        if cifar_stem:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, planes[0], 3, 1, 1, bias=False),
                nn.BatchNorm2d(planes[0]),
                nn.ReLU(),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, planes[0], 7, 2, 3, bias=False),
                nn.BatchNorm2d(planes[0]),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
        stages: list[nn.Module] = []
        in_planes = planes[0]
        for i, (p, n) in enumerate(zip(planes, counts, strict=True)):
            blocks = []
            for j in range(n):
                blocks.append(block(in_planes, p, 2 if (i > 0 and j == 0) else 1))
                in_planes = p * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_planes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, BasicBlock | Bottleneck):
                    nn.init.zeros_(m.last_bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class ResNetClassifier(Classifier):
    """Image classification with :class:`ResNet`; batches are ``(images, labels)``.

    Args:
        num_classes: number of classes.
        in_channels: channels of the input images.
        depth: see :class:`ResNet`.
        width: see :class:`ResNet`.
        cifar_stem: see :class:`ResNet`.
        zero_init_residual: see :class:`ResNet`.
        **optim: optimizer settings of :class:`~recipes.models.classifier.Classifier`.

    Example:
        >>> module = ResNetClassifier(num_classes=10, in_channels=1, width=0.125)
        >>> batch = (torch.randn(2, 1, 32, 32), torch.zeros(2))
        >>> logits, y = module.logits_and_targets(batch, "train")
        >>> logits.shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        depth: int = 18,
        width: float = 1.0,
        cifar_stem: bool = True,
        zero_init_residual: bool = False,
        **optim: float | str,
    ) -> None:
        super().__init__(num_classes, **optim)  # type: ignore[arg-type]
        self.save_hyperparameters()
        self.net = ResNet(depth, num_classes, in_channels, width, cifar_stem, zero_init_residual)

    def logits_and_targets(
        self, batch: tuple[torch.Tensor, torch.Tensor], stage: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        return self.net(x), y.long()
