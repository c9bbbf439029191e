"""AmoebaNet-D (Real et al. 2019) as scaled in the GPipe paper: AmoebaNet-D (L, F)."""

from __future__ import annotations

import torch
from torch import nn

# fmt: off
NORMAL_CELL: tuple[tuple[str, int], ...] = (
    ("conv_1x1", 1), ("max_pool_3x3", 1),      # node 2
    ("identity", 1), ("conv_1x7_7x1", 0),      # node 3
    ("conv_1x1", 0), ("conv_1x7_7x1", 0),      # node 4
    ("max_pool_3x3", 2), ("identity", 2),      # node 5
    ("avg_pool_3x3", 1), ("conv_1x1", 5),      # node 6
)
"""AmoebaNet-D normal cell: (operation, input state) pairs; node ``2 + i`` sums pair ``i``."""

NORMAL_CONCAT: tuple[int, ...] = (0, 3, 4, 6)
"""States concatenated into a normal cell's output (the published spec also keeps state 0)."""

REDUCTION_CELL: tuple[tuple[str, int], ...] = (
    ("max_pool_2x2", 0), ("max_pool_3x3", 0),  # node 2
    ("identity", 2), ("conv_3x3", 1),          # node 3
    ("conv_1x7_7x1", 2), ("max_pool_3x3", 2),  # node 4
    ("identity", 3), ("max_pool_2x2", 1),      # node 5
    ("avg_pool_3x3", 2), ("conv_1x1", 3),      # node 6
)
"""AmoebaNet-D reduction cell; operations reading states 0 or 1 have stride 2."""

REDUCTION_CONCAT: tuple[int, ...] = (4, 5, 6)
"""States concatenated into a reduction cell's output (the nodes no other node consumes)."""
# fmt: on


class ReLUConvBN(nn.Module):
    """ReLU, one bias-free convolution, BatchNorm."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
    ) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(
            in_channels, out_channels, kernel, stride=stride, padding=padding, bias=False
        )
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(self.relu(x)))


class Conv1x7x7x1(nn.Module):
    """Factorized 7x7 conv in a 4x bottleneck: 1x1 down, 1x7, 7x1 (stride split), 1x1 up.

    Every step is ReLU-conv-BN. The bottleneck keeps AmoebaNet-D (18, 208) at about the 82M
    parameters of the GPipe paper; full-width 1x7/7x1 convs would triple the model.
    """

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        inner = max(1, channels // 4)
        self.reduce = ReLUConvBN(channels, inner, 1)
        self.conv_1x7 = ReLUConvBN(inner, inner, (1, 7), stride=(1, stride), padding=(0, 3))
        self.conv_7x1 = ReLUConvBN(inner, inner, (7, 1), stride=(stride, 1), padding=(3, 0))
        self.expand = ReLUConvBN(inner, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expand(self.conv_7x1(self.conv_1x7(self.reduce(x))))


class FactorizedReduce(nn.Module):
    """Halve the spatial size without losing pixels: ReLU, two 1x1 stride-2 convs (one on the input
    shifted by one pixel), channel concat, BN. Output size is ``ceil(H / 2) x ceil(W / 2)``."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv_a = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.shift = nn.ZeroPad2d(
            (-1, 1, -1, 1)
        )  # crop first row/col, zero-pad last: 1-pixel shift
        self.conv_b = nn.Conv2d(
            in_channels, out_channels - out_channels // 2, 1, stride=2, bias=False
        )
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        return self.bn(torch.cat([self.conv_a(x), self.conv_b(self.shift(x))], dim=1))


def make_op(name: str, channels: int, stride: int) -> nn.Module:
    """One cell operation on ``channels`` channels; stride 2 halves H and W, rounding up."""
    if name == "conv_1x1":
        return ReLUConvBN(channels, channels, 1, stride=stride)
    if name == "conv_3x3":
        return ReLUConvBN(channels, channels, 3, stride=stride, padding=1)
    if name == "conv_1x7_7x1":
        return Conv1x7x7x1(channels, stride)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, stride=stride, padding=1)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)
    if name == "max_pool_2x2" and stride == 2:
        return nn.MaxPool2d(2, stride=2, ceil_mode=True)
    if name == "identity":
        return nn.Identity() if stride == 1 else FactorizedReduce(channels, channels)
    raise ValueError(f"unknown AmoebaNet operation {name!r} with stride {stride}")


class Cell(nn.Module):
    """One AmoebaNet cell over the two previous cell outputs.

    Both inputs are preprocessed to ``channels`` channels (ReLU-conv1x1-BN, or a factorized
    reduction of the prev-prev input when the previous cell halved the resolution); five nodes
    each sum two operations applied to earlier states; the cell output concatenates the states
    listed in the concat spec (``len(concat) * channels`` channels).
    """

    def __init__(
        self,
        prev_prev_channels: int,
        prev_channels: int,
        channels: int,
        reduction: bool,
        reduce_prev: bool,
    ) -> None:
        super().__init__()
        self.preprocess0: nn.Module
        if reduce_prev:
            self.preprocess0 = FactorizedReduce(prev_prev_channels, channels)
        else:
            self.preprocess0 = ReLUConvBN(prev_prev_channels, channels, 1)
        self.preprocess1 = ReLUConvBN(prev_channels, channels, 1)
        spec = REDUCTION_CELL if reduction else NORMAL_CELL
        self.inputs: tuple[int, ...] = tuple(index for _, index in spec)
        self.concat: tuple[int, ...] = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
        self.ops = nn.ModuleList(
            make_op(name, channels, 2 if reduction and index < 2 else 1) for name, index in spec
        )
        self.out_channels = len(self.concat) * channels

    def forward(self, prev_prev: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        states = [self.preprocess0(prev_prev), self.preprocess1(prev)]
        for node in range(len(self.ops) // 2):
            left, right = 2 * node, 2 * node + 1
            a = self.ops[left](states[self.inputs[left]])
            b = self.ops[right](states[self.inputs[right]])
            states.append(a + b)
        return torch.cat([states[index] for index in self.concat], dim=1)


class AmoebaNetD(nn.Module):
    """Stem conv, two stem reduction cells, three normal-cell groups split by reduction cells."""

    def __init__(self, num_layers: int, num_filters: int, num_classes: int) -> None:
        super().__init__()
        stem_channels = num_filters // 4
        self.stem = nn.Sequential(
            nn.Conv2d(3, stem_channels, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(stem_channels),
        )
        plan: list[tuple[int, bool]] = [(num_filters // 4, True), (num_filters // 2, True)]
        for group in range(3):
            if group > 0:
                plan.append((num_filters * 2**group, True))
            plan.extend([(num_filters * 2**group, False)] * (num_layers // 3))
        cells: list[Cell] = []
        prev_prev, prev, reduce_prev = stem_channels, stem_channels, False
        for channels, reduction in plan:
            cell = Cell(prev_prev, prev, channels, reduction, reduce_prev)
            cells.append(cell)
            prev_prev, prev, reduce_prev = prev, cell.out_channels, reduction
        self.cells = nn.ModuleList(cells)
        self.relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev_prev = prev = self.stem(x)
        for cell in self.cells:
            prev_prev, prev = prev, cell(prev_prev, prev)
        return self.fc(torch.flatten(self.avgpool(self.relu(prev)), 1))


def amoebanet_d(
    *,
    num_layers: int = 18,
    num_filters: int = 256,
    num_classes: int = 1000,
    device: str | torch.device = "meta",
) -> nn.Module:
    """Build AmoebaNet-D (L=``num_layers``, F=``num_filters``) as benchmarked in GPipe.

    Architecture: 3x3 stride-2 conv to F/4 channels + BN; two stem reduction cells with F/4 and
    F/2 channels per node; then three groups of ``L / 3`` normal cells with F, 2F and 4F
    channels per node, separated by reduction cells (2F, 4F) that halve the resolution; ReLU,
    global average pooling, linear. Each cell preprocesses its two inputs (previous and
    prev-previous cell outputs) with ReLU-conv1x1-BN (factorized reduce for prev-previous after a
    reduction), then builds five nodes that each sum two branches of the AmoebaNet-D genotype
    (``NORMAL_CELL`` / ``REDUCTION_CELL``: 1x1 conv, 3x3 conv, 1x7-7x1 conv, 3x3 max/avg pool,
    2x2 max pool, identity), and concatenates the unconsumed states (4 x channels for normal
    cells, 3 x channels for reduction cells). Every conv op is ReLU-Conv-BN. The network halves
    the resolution five times; 224x224 and 64x64 inputs (and any size >= 32) work.

    Args:
        num_layers: Normal cells in total (L); must be a positive multiple of 3.
        num_filters: Channels per node in the first normal group (F); must be at least 8.
        num_classes: Output logits per image.
        device: Where parameters live; ``"meta"`` (the default) allocates no memory.

    Returns:
        The model in train mode; input ``(N, 3, H, W)``, output ``(N, num_classes)``.

    Raises:
        ValueError: If ``num_layers`` or ``num_filters`` is out of range.

    Example:
        >>> model = amoebanet_d(num_layers=3, num_filters=16, num_classes=10, device="cpu")
        >>> model(torch.randn(2, 3, 64, 64)).shape
        torch.Size([2, 10])
    """
    if num_layers < 3 or num_layers % 3 != 0:
        raise ValueError(
            f"amoebanet_d num_layers={num_layers} is invalid; need a positive multiple of 3"
        )
    if num_filters < 8:
        raise ValueError(f"amoebanet_d num_filters={num_filters} is invalid; need num_filters >= 8")
    with torch.device(device):
        return AmoebaNetD(num_layers, num_filters, num_classes).train()
