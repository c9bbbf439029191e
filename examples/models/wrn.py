"""Wide residual networks (Zagoruyko & Komodakis), e.g. WRN-28-10 for CIFAR."""

from __future__ import annotations

import torch
from torch import nn


class WideBasicBlock(nn.Module):
    """Pre-activation basic block: BN-ReLU-conv3x3 (stride), BN-ReLU-dropout-conv3x3, plus shortcut.

    When the shape changes the shortcut is a 1x1 conv of the pre-activated input; otherwise it is
    the raw input.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.projection: nn.Conv2d | None = None
        if stride != 1 or in_channels != out_channels:
            self.projection = nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.relu1(self.bn1(x))
        # Static structure (fixed at construction), not data-dependent control flow.
        shortcut = x if self.projection is None else self.projection(pre)
        out = self.conv1(pre)
        out = self.conv2(self.dropout(self.relu2(self.bn2(out))))
        return out + shortcut


class WideResNet(nn.Module):
    """3x3 stem to 16 channels, three stages of wide basic blocks, BN-ReLU, global pool, linear."""

    def __init__(
        self, blocks_per_stage: int, widen_factor: int, num_classes: int, dropout: float
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        stages: list[nn.Module] = []
        in_channels = 16
        for index, stride in enumerate((1, 2, 2)):
            out_channels = 16 * widen_factor * 2**index
            layers: list[nn.Module] = []
            for block in range(blocks_per_stage):
                layers.append(
                    WideBasicBlock(in_channels, out_channels, stride if block == 0 else 1, dropout)
                )
                in_channels = out_channels
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


def wrn(
    depth: int = 28,
    widen_factor: int = 10,
    *,
    num_classes: int = 10,
    dropout: float = 0.0,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Build a wide ResNet WRN-``depth``-``widen_factor``.

    Architecture: bias-free 3x3 conv to 16 channels, then three stages of
    ``n = (depth - 4) // 6`` pre-activation basic blocks with ``16k, 32k, 64k`` channels
    (``k = widen_factor``) and strides 1, 2, 2 (in the first block of each stage); a bias-free 1x1
    conv shortcut where the shape changes; final BN-ReLU, adaptive average pooling, linear.
    WRN-28-10 at 10 classes has 36,479,194 parameters.

    Args:
        depth: Total depth; ``depth - 4`` must be a positive multiple of 6.
        widen_factor: Channel multiplier ``k``.
        num_classes: Output logits per image.
        dropout: Dropout probability between the two convs of each block.
        device: Where parameters live; ``"meta"`` (the default) allocates no memory.

    Returns:
        The model in train mode; input ``(N, 3, H, W)``, output ``(N, num_classes)``.

    Raises:
        ValueError: If ``depth`` is not ``6n + 4`` with ``n >= 1`` or ``widen_factor < 1``.

    Example:
        >>> model = wrn(16, 4, device="cpu")
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    if depth < 10 or (depth - 4) % 6 != 0:
        raise ValueError(
            f"wrn depth={depth} is invalid; need depth = 6n + 4 with n >= 1 (e.g. 16, 28, 40)"
        )
    if widen_factor < 1:
        raise ValueError(f"wrn widen_factor={widen_factor} is invalid; need widen_factor >= 1")
    with torch.device(device):
        return WideResNet((depth - 4) // 6, widen_factor, num_classes, dropout).train()


def wrn_28_10(
    *, num_classes: int = 10, dropout: float = 0.0, device: str | torch.device = "meta"
) -> nn.Module:
    """WRN-28-10 (36.5M parameters at 10 classes); see :func:`wrn`.

    Example:
        >>> model = wrn_28_10(dropout=0.3)  # meta device
    """
    return wrn(28, 10, num_classes=num_classes, dropout=dropout, device=device)
