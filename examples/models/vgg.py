"""VGG-16 (configuration D of Simonyan & Zisserman), optionally with batch normalization."""

from __future__ import annotations

import torch
from torch import nn

# fmt: off
VGG16_LAYOUT: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)
# fmt: on
"""Output channels of each 3x3 conv in order; ``"M"`` is a 2x2 stride-2 max pool."""


class VGG(nn.Module):
    """Stack of 3x3 convs and max pools, 7x7 adaptive average pool, three-layer MLP classifier."""

    def __init__(self, layout: tuple[int | str, ...], num_classes: int, batch_norm: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for item in layout:
            if item == "M":
                layers.append(nn.MaxPool2d(2, stride=2))
                continue
            out_channels = int(item)
            layers.append(nn.Conv2d(in_channels, out_channels, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out_channels))
            layers.append(nn.ReLU())
            in_channels = out_channels
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(
            nn.Linear(in_channels * 7 * 7, 4096),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def vgg16(
    *, num_classes: int = 1000, batch_norm: bool = False, device: str | torch.device = "meta"
) -> nn.Module:
    """Build VGG-16.

    Architecture: 13 3x3 convs (padding 1, with bias) in the layout
    64,64,M,128,128,M,256x3,M,512x3,M,512x3,M, each followed by ReLU (BN + ReLU when
    ``batch_norm``); adaptive average pooling to 7x7; classifier Linear(25088, 4096)-ReLU-Dropout,
    Linear(4096, 4096)-ReLU-Dropout, Linear(4096, num_classes). 138,357,544 parameters at 1000
    classes without BN. Inputs of 32x32 or larger work (five 2x2 pools).

    Args:
        num_classes: Output logits per image.
        batch_norm: Insert BatchNorm2d after every conv (VGG-16-BN).
        device: Where parameters live; ``"meta"`` (the default) allocates no memory.

    Returns:
        The model in train mode; input ``(N, 3, H, W)``, output ``(N, num_classes)``.

    Example:
        >>> model = vgg16(num_classes=10, device="cpu")
        >>> model(torch.randn(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """
    with torch.device(device):
        return VGG(VGG16_LAYOUT, num_classes, batch_norm).train()
