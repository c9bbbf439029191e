"""U-Net (Ronneberger et al. 2015) with batch normalization for high-resolution segmentation."""

from __future__ import annotations

import torch
from torch import nn


class DoubleConv(nn.Module):
    """Two (3x3 conv, padding 1, bias-free) + BN + ReLU stages; keeps the spatial size."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(x)))


class UNet(nn.Module):
    """Encoder (DoubleConv + 2x2 max pool per level), bottleneck, decoder (2x2 transposed conv,
    skip concat, DoubleConv per level), 1x1 output conv."""

    def __init__(self, in_channels: int, num_classes: int, base_width: int, depth: int) -> None:
        super().__init__()
        widths = [base_width * 2**level for level in range(depth + 1)]
        self.encoders = nn.ModuleList()
        self.pools = nn.ModuleList()
        channels = in_channels
        for level in range(depth):
            self.encoders.append(DoubleConv(channels, widths[level]))
            self.pools.append(nn.MaxPool2d(2, stride=2))
            channels = widths[level]
        self.bottleneck = DoubleConv(channels, widths[depth])
        self.upsamples = nn.ModuleList()
        self.decoders = nn.ModuleList()
        for level in reversed(range(depth)):
            self.upsamples.append(nn.ConvTranspose2d(widths[level + 1], widths[level], 2, stride=2))
            self.decoders.append(DoubleConv(2 * widths[level], widths[level]))
        self.head = nn.Conv2d(base_width, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips: list[torch.Tensor] = []
        for encoder, pool in zip(self.encoders, self.pools, strict=True):
            x = encoder(x)
            skips.append(x)
            x = pool(x)
        x = self.bottleneck(x)
        for upsample, decoder, skip in zip(
            self.upsamples, self.decoders, reversed(skips), strict=True
        ):
            x = decoder(torch.cat([skip, upsample(x)], dim=1))
        return self.head(x)


def unet(
    *,
    in_channels: int = 3,
    num_classes: int = 2,
    base_width: int = 64,
    depth: int = 4,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Build a U-Net for dense (per-pixel) segmentation.

    Architecture: ``depth`` encoder levels with widths ``base_width * 2**level``, each two
    (3x3 conv, padding 1) + BN + ReLU then a 2x2 max pool; a bottleneck DoubleConv at
    ``base_width * 2**depth``; ``depth`` decoder levels, each a 2x2 stride-2 ConvTranspose2d
    halving the channels, concatenation with the matching encoder feature map (skip, dim 1), and
    two 3x3 conv + BN + ReLU; a final 1x1 conv to ``num_classes``. The defaults (64, 4) are the
    original U-Net widths (31.0M parameters with BN, bias-free 3x3 convs).

    Args:
        in_channels: Input image channels.
        num_classes: Output channels (per-pixel logits).
        base_width: Channels of the first encoder level.
        depth: Number of pooling levels; H and W must be divisible by ``2**depth``.
        device: Where parameters live; ``"meta"`` (the default) allocates no memory.

    Returns:
        The model in train mode; input ``(N, in_channels, H, W)``, output
        ``(N, num_classes, H, W)``.

    Raises:
        ValueError: If ``depth`` or ``base_width`` is less than 1.

    Example:
        >>> model = unet(base_width=8, depth=3, device="cpu")
        >>> model(torch.randn(1, 3, 64, 64)).shape
        torch.Size([1, 2, 64, 64])
    """
    if depth < 1 or base_width < 1:
        raise ValueError(
            f"unet needs depth >= 1 and base_width >= 1, got depth={depth}, base_width={base_width}"
        )
    with torch.device(device):
        return UNet(in_channels, num_classes, base_width, depth).train()


def unet_small(
    *, in_channels: int = 3, num_classes: int = 2, device: str | torch.device = "meta"
) -> nn.Module:
    """Small U-Net for tests: base_width 8, depth 3; see :func:`unet`.

    Example:
        >>> model = unet_small(device="cpu")
    """
    return unet(
        in_channels=in_channels, num_classes=num_classes, base_width=8, depth=3, device=device
    )
