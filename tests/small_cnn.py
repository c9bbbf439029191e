"""A small CNN for runtime tests whose gradients 16-bit arithmetic resolves.

At initialisation the narrow ResNet-50 of tests/runtime_plans.py has gradients that bf16 and fp16 runs
get wrong by more than their size (normwise, against float64: its 53 batch-norms over two samples amplify
each rounding), so they cannot show that a 16-bit run computes what it should. This model's can.
"""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Conv-BN-ReLU, max pool, conv-ReLU (all tileable), then a strided conv, average pool and a linear head."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)  # a bias before a batch-norm has no gradient
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1)
        self.relu3 = nn.ReLU()
        self.head = nn.Linear(2 * channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv2(self.pool(self.relu1(self.bn1(self.conv1(x)))))
        x = self.relu3(self.conv3(self.relu2(x)))
        return self.head(x.mean(dim=(2, 3)))


def small_cnn(*, channels: int = 8, num_classes: int = 10, device: str | torch.device = "meta") -> nn.Module:
    with torch.device(device):
        return SmallCNN(channels, num_classes).train()
