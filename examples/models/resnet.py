"""Bottleneck ResNets: ImageNet ResNet-50/101/152/200 and the pre-activation CIFAR ResNet-1001."""

from __future__ import annotations

import torch
from torch import nn

RESNET_STAGE_BLOCKS: dict[int, tuple[int, int, int, int]] = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}
"""Bottleneck blocks per stage for each supported ImageNet ResNet depth."""

EXPANSION = 4
"""Output channels of a bottleneck block divided by its inner (bottleneck) width."""


class Bottleneck(nn.Module):
    """Post-activation bottleneck: 1x1, 3x3 (with stride), 1x1, BN after each, ReLU after add."""

    def __init__(self, in_channels: int, planes: int, stride: int) -> None:
        super().__init__()
        out_channels = planes * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(planes, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu3 = nn.ReLU()
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu3(out + self.shortcut(x))


class ResNet(nn.Module):
    """ImageNet bottleneck ResNet: 7x7/2 stem, 3x3/2 max pool, four stages, global pool, linear."""

    def __init__(self, stage_blocks: tuple[int, ...], num_classes: int, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages: list[nn.Module] = []
        in_channels = width
        for index, blocks in enumerate(stage_blocks):
            planes = width * 2**index
            layers: list[nn.Module] = []
            for block in range(blocks):
                stride = 2 if index > 0 and block == 0 else 1
                layers.append(Bottleneck(in_channels, planes, stride))
                in_channels = planes * EXPANSION
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class PreActBottleneck(nn.Module):
    """Identity-mapping bottleneck: BN-ReLU-1x1, BN-ReLU-3x3 (stride), BN-ReLU-1x1, no ReLU at end.

    When the shape changes, the 1x1 projection shortcut reads the pre-activated input (after the
    block's first BN-ReLU), as in He et al. 2016; otherwise the shortcut is the raw input.
    """

    def __init__(self, in_channels: int, planes: int, stride: int) -> None:
        super().__init__()
        out_channels = planes * EXPANSION
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes)
        self.relu3 = nn.ReLU()
        self.conv3 = nn.Conv2d(planes, out_channels, 1, bias=False)
        self.projection: nn.Conv2d | None = None
        if stride != 1 or in_channels != out_channels:
            self.projection = nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.relu1(self.bn1(x))
        # Static structure (fixed at construction), not data-dependent control flow.
        shortcut = x if self.projection is None else self.projection(pre)
        out = self.conv1(pre)
        out = self.conv2(self.relu2(self.bn2(out)))
        out = self.conv3(self.relu3(self.bn3(out)))
        return out + shortcut


class PreActResNet(nn.Module):
    """CIFAR pre-activation bottleneck ResNet: 3x3 stem, 3 stages, final BN-ReLU, pool, linear."""

    def __init__(self, blocks_per_stage: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        stages: list[nn.Module] = []
        in_channels = width
        for index in range(3):
            planes = width * 2**index
            layers: list[nn.Module] = []
            for block in range(blocks_per_stage):
                stride = 2 if index > 0 and block == 0 else 1
                layers.append(PreActBottleneck(in_channels, planes, stride))
                in_channels = planes * EXPANSION
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3 = stages
        self.bn = nn.BatchNorm2d(in_channels)
        self.relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        x = self.avgpool(self.relu(self.bn(x)))
        return self.fc(torch.flatten(x, 1))


def resnet(
    depth: int, *, num_classes: int = 1000, width: int = 64, device: str | torch.device = "meta"
) -> nn.Module:
    """Build an ImageNet-style bottleneck ResNet of the given depth.

    Architecture: 7x7 stride-2 conv (``width`` channels) + BN + ReLU, 3x3 stride-2 max pool, then
    four stages of bottleneck blocks (inner widths ``width * (1, 2, 4, 8)``, outputs x4) with
    ``RESNET_STAGE_BLOCKS[depth]`` blocks each; the first block of stages 2-4 strides by 2 in its
    3x3 conv, and a 1x1 conv + BN projection shortcut is used wherever the shape changes. Adaptive
    average pooling to 1x1 and a linear classifier follow, so any input of 32x32 or larger works.
    Depth 50 with the defaults has 25,557,032 parameters.

    Args:
        depth: One of 50, 101, 152, 200.
        num_classes: Output logits per image.
        width: Stem channels (64 for the standard network); stage widths scale with it.
        device: Where parameters live; ``"meta"`` (the default) allocates no memory.

    Returns:
        The model in train mode; input ``(N, 3, H, W)``, output ``(N, num_classes)``.

    Raises:
        ValueError: If ``depth`` is not in the table.

    Example:
        >>> model = resnet(101, num_classes=10, device="cpu")
        >>> model(torch.randn(2, 3, 64, 64)).shape
        torch.Size([2, 10])
    """
    if depth not in RESNET_STAGE_BLOCKS:
        valid = ", ".join(str(d) for d in sorted(RESNET_STAGE_BLOCKS))
        raise ValueError(f"resnet depth={depth} is not supported; valid depths are {valid}")
    with torch.device(device):
        return ResNet(RESNET_STAGE_BLOCKS[depth], num_classes, width).train()


def resnet50(
    *, num_classes: int = 1000, width: int = 64, device: str | torch.device = "meta"
) -> nn.Module:
    """ResNet-50, blocks (3, 4, 6, 3); see :func:`resnet`. Example: ``resnet50(device="cpu")``."""
    return resnet(50, num_classes=num_classes, width=width, device=device)


def resnet101(
    *, num_classes: int = 1000, width: int = 64, device: str | torch.device = "meta"
) -> nn.Module:
    """ResNet-101, blocks (3, 4, 23, 3); see :func:`resnet`. Example: ``resnet101()`` (meta)."""
    return resnet(101, num_classes=num_classes, width=width, device=device)


def resnet152(
    *, num_classes: int = 1000, width: int = 64, device: str | torch.device = "meta"
) -> nn.Module:
    """ResNet-152, blocks (3, 8, 36, 3); see :func:`resnet`. Example: ``resnet152()`` (meta)."""
    return resnet(152, num_classes=num_classes, width=width, device=device)


def resnet200(
    *, num_classes: int = 1000, width: int = 64, device: str | torch.device = "meta"
) -> nn.Module:
    """ResNet-200, blocks (3, 24, 36, 3); see :func:`resnet`. Example: ``resnet200()`` (meta)."""
    return resnet(200, num_classes=num_classes, width=width, device=device)


def preact_resnet(
    depth: int = 1001,
    *,
    num_classes: int = 10,
    width: int = 16,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Build a CIFAR-style pre-activation ("ResNet v2", identity-mapping) bottleneck ResNet.

    Architecture: 3x3 stride-1 conv to ``width`` channels, then three stages of
    ``n = (depth - 2) // 9`` pre-activation bottleneck blocks with inner widths
    ``width * (1, 2, 4)`` (outputs x4); the first block of stages 2 and 3 strides by 2 in its 3x3
    conv. Each block is BN-ReLU-conv1x1, BN-ReLU-conv3x3, BN-ReLU-conv1x1 plus a shortcut (a 1x1
    projection of the pre-activated input when the shape changes, else identity). A final
    BN-ReLU, adaptive average pooling and a linear layer follow, so 32x32 through 1024x1024 inputs
    work. Depth 1001 gives 333 blocks (He et al., "Identity Mappings in Deep Residual Networks").

    Args:
        depth: Total weighted layers; ``depth - 2`` must be divisible by 9.
        num_classes: Output logits per image.
        width: Stem channels and first-stage bottleneck width (16 in the paper).
        device: Where parameters live; ``"meta"`` (the default) allocates no memory.

    Returns:
        The model in train mode; input ``(N, 3, H, W)``, output ``(N, num_classes)``.

    Raises:
        ValueError: If ``(depth - 2) % 9 != 0`` or the depth gives no blocks.

    Example:
        >>> model = preact_resnet(29, device="cpu")  # 3 blocks per stage
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    if depth < 11 or (depth - 2) % 9 != 0:
        raise ValueError(
            f"preact_resnet depth={depth} is invalid; "
            "need depth = 9n + 2 with n >= 1 (e.g. 164, 1001)"
        )
    with torch.device(device):
        return PreActResNet((depth - 2) // 9, num_classes, width).train()


def resnet1001(
    *, num_classes: int = 10, width: int = 16, device: str | torch.device = "meta"
) -> nn.Module:
    """Pre-activation ResNet-1001 (333 bottleneck blocks); see :func:`preact_resnet`.

    Example:
        >>> model = resnet1001()  # meta device, no memory allocated
    """
    return preact_resnet(1001, num_classes=num_classes, width=width, device=device)
