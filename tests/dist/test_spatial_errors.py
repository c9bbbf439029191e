"""Layers that cannot be tiled exactly fail before any communication, with an error naming the layer."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from cost_models.errors import SpatialError, TesseraError
from examples.models.amoebanet import Cell
from examples.models.resnet import resnet50
from runtime.spatial import (
    FusedHaloBlock,
    SpatialConv2d,
    SpatialMaxPool2d,
    TileGrid,
    fuse_sequential,
    spatialize,
)

GRID = TileGrid.build(4, "square", 64, 64)


def _named(**layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(OrderedDict(layers))


class _ShapeDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) if x.sum() > 0 else x


class _StridedSkip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 3, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(x) + x


class _FlattenInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.conv(x), 1)


class _CatAlongHeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.conv(x), x], dim=2)


def _groups_not_dividing() -> nn.Module:
    conv = nn.Conv2d(4, 4, 3, padding=1)
    conv.groups = 3  # e.g. a hand-edited module: 4 channels do not split into 3 groups
    return _named(grouped=conv)


UNTILEABLE = [
    ("global pooling", lambda: _named(conv=nn.Conv2d(3, 8, 3, padding=1), relu=nn.ReLU(),
                                      pool=nn.AdaptiveAvgPool2d(1)), r"'pool' \(AdaptiveAvgPool2d\).*whole image.*join"),
    ("resnet head", lambda: resnet50(width=8, device="cpu"), r"'avgpool' \(AdaptiveAvgPool2d\)"),
    ("reflect padding", lambda: _named(stem=nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect")),
     r"'stem'.*padding_mode='reflect'.*zeros"),
    ("ceil mode", lambda: _named(conv=nn.Conv2d(3, 8, 3), down=nn.MaxPool2d(3, 2, ceil_mode=True)),
     r"'down' \(MaxPool2d\).*ceil_mode=True"),
    ("avg pool ceil mode", lambda: _named(down=nn.AvgPool2d(3, 2, ceil_mode=True)), r"'down' \(AvgPool2d\).*ceil_mode"),
    ("reduction cell", lambda: Cell(8, 8, 8, reduction=True, reduce_prev=True), r"'preprocess0.shift' \(ZeroPad2d\)"),
    ("return indices", lambda: _named(pool=nn.MaxPool2d(3, 1, 1, return_indices=True)), r"'pool'.*return_indices"),
    ("even kernel padding same", lambda: _named(conv=nn.Conv2d(3, 3, 4, padding="same")), r"'conv'.*padding='same'"),
    ("groups that do not divide", _groups_not_dividing, r"'grouped'.*groups=3 does not divide"),
    ("dropout", lambda: _named(conv=nn.Conv2d(3, 3, 3, padding=1), drop=nn.Dropout(0.5)), r"'drop' \(Dropout\)"),
    ("linear", lambda: _named(flat=nn.Flatten(), fc=nn.Linear(3, 2)), r"'flat' \(Flatten\)"),
    ("upsample", lambda: _named(up=nn.Upsample(scale_factor=2)), r"'up' \(Upsample\)"),
    ("transposed conv", lambda: _named(up=nn.ConvTranspose2d(3, 3, 2, 2)), r"'up' \(ConvTranspose2d\)"),
    ("flatten function", _FlattenInForward, r"'flatten'"),
    ("cat along height", _CatAlongHeight, r"'cat'.*dim=2"),
    ("strided skip", _StridedSkip, r"'add' combines tensors tiled differently"),
    ("data-dependent control flow", _ShapeDependent, r"_ShapeDependent cannot be traced"),
]


@pytest.mark.parametrize(("case", "build", "message"), UNTILEABLE, ids=[case for case, _, _ in UNTILEABLE])
def test_spatialize_names_the_first_untileable_layer(case: str, build: object, message: str) -> None:
    with pytest.raises(SpatialError, match=message):
        spatialize(build(), GRID, None)  # type: ignore[operator]


@pytest.mark.parametrize("case", ["global pooling", "reduction cell", "strided skip"])
def test_fused_blocks_reject_the_same_layers(case: str) -> None:
    _, build, message = next(entry for entry in UNTILEABLE if entry[0] == case)
    with pytest.raises(SpatialError, match=message):
        FusedHaloBlock(build(), GRID, None)  # type: ignore[operator]


def test_spatial_error_is_a_tessera_error() -> None:
    assert issubclass(SpatialError, TesseraError)


def test_single_layers_are_checked_before_any_communication() -> None:
    with pytest.raises(SpatialError, match=r"'stem' \(Conv2d\): padding_mode='circular'"):
        SpatialConv2d.from_module(nn.Conv2d(3, 3, 3, padding=1, padding_mode="circular"), GRID, None, name="stem")
    with pytest.raises(SpatialError, match=r"'pool' \(MaxPool2d\): ceil_mode=True"):
        SpatialMaxPool2d.from_module(nn.MaxPool2d(3, 2, ceil_mode=True), GRID, None, name="pool")
    with pytest.raises(SpatialError, match=r"'AdaptiveAvgPool2d' \(AdaptiveAvgPool2d\)"):
        spatialize(nn.AdaptiveAvgPool2d(1), GRID, None)


def test_a_tile_left_without_output_pixels_is_an_error() -> None:
    strips = TileGrid.build(4, "vertical", 64, 64)  # a valid 41-wide window leaves the first strip nothing
    with pytest.raises(SpatialError, match=r"'valid'.*output tiles \[0, .*own no output pixel.*fewer tiles"):
        spatialize(_named(valid=nn.Conv2d(3, 3, 41)), strips, None)


def test_fuse_sequential_checks_the_group_sizes() -> None:
    with pytest.raises(SpatialError, match=r"sizes \[2, 2\] must be positive and add up to the 3 layers"):
        fuse_sequential(nn.Sequential(nn.ReLU(), nn.ReLU(), nn.ReLU()), GRID, None, [2, 2])
