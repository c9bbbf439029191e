"""A spatial stage's cut, without processes: fused groups with recompute and swap regions, and the
one-line refusals of groups and regions the runtime cannot run (before any communication)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx
from torch import nn

from cost_models.errors import RuntimeSetupError
from planner.plan import OffloadSpec, Plan, SpatialSpec
from runtime.build import rebuild_model, split_stages, trace_checked
from runtime.spatial_stage import Piece, check_spatial_stage, pieces
from tests.runtime_plans import RESNET, make_plan

STEM = ("conv1", "bn1", "relu", "maxpool")
CONVS = ("layer1_0_conv1", "layer1_0_bn1", "layer1_0_relu1", "layer1_0_conv2", "layer1_0_bn2", "layer1_0_relu2")
FUSED = SpatialSpec(2, "vertical", "fused", 64, 64, fused_groups=(STEM, CONVS))


@pytest.fixture(scope="module")
def stem_stage() -> torch.fx.GraphModule:
    """Stage 0 of ResNet-50 (width 4, meta weights): the stem and the first bottleneck block."""
    plan = Plan.from_dict(json.loads(make_plan(RESNET, ["layer1_1_conv1"], schedule="gpipe")))
    model = rebuild_model(plan)
    return split_stages(trace_checked(model, plan), model, plan)[0]


def test_fused_groups_recompute_and_swap_are_cut_once(stem_stage: torch.fx.GraphModule) -> None:
    offload = OffloadSpec(recompute=(CONVS, ("layer1_0_conv3", "layer1_0_bn3")),
                          swap=(*STEM, "layer1_0_shortcut_0", "layer1_0_shortcut_1"))
    assert pieces(stem_stage, FUSED, offload, stage=0) == {
        "fused_groups[0]": Piece(STEM, fused=True, swapped=True),  # a swapped run is cut at the group's edge
        "fused_groups[1]": Piece(CONVS, fused=True, recomputed=True),
        "recompute[1]": Piece(("layer1_0_conv3", "layer1_0_bn3"), recomputed=True),
        "swap[1]": Piece(("layer1_0_shortcut_0", "layer1_0_shortcut_1"), swapped=True)}
    check_spatial_stage(stem_stage, FUSED, offload, {}, stage=0)  # stage 0: every input is the image
    whole = SpatialSpec(2, "vertical", "fused", 64, 64)  # no groups listed: the whole stage is one
    assert pieces(stem_stage, whole, OffloadSpec(), stage=0) == {
        "fused_groups[0]": Piece((*STEM, *CONVS, "layer1_0_conv3", "layer1_0_bn3", "layer1_0_shortcut_0",
                                  "layer1_0_shortcut_1", "add", "layer1_0_relu3"), fused=True)}
    assert pieces(stem_stage, SpatialSpec(2, "vertical", "per-layer", 64, 64), offload, stage=0) == {
        "recompute[0]": Piece(CONVS, recomputed=True),
        "recompute[1]": Piece(("layer1_0_conv3", "layer1_0_bn3"), recomputed=True),
        "swap[0]": Piece(STEM, swapped=True), "swap[1]": Piece(("layer1_0_shortcut_0", "layer1_0_shortcut_1"),
                                                               swapped=True)}


class _TwoLevels(nn.Module):
    """Reads the image at two tilings: a strided conv's output and the image itself."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 3, 3, stride=2, padding=1)
        self.strided = nn.Conv2d(3, 3, 3, stride=2, padding=1)
        self.same = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.down(x)
        return self.strided(x), self.same(half)


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.conv(x))


def _small(groups: tuple[tuple[str, ...], ...]) -> SpatialSpec:
    return SpatialSpec(2, "vertical", "fused", 16, 16, fused_groups=groups)


@pytest.mark.parametrize(("module", "spec", "offload", "message"), [
    (None, _small((("conv1", "relu"),)), OffloadSpec(),
     (r"^stage 0's spatial fused_groups\[0\] \['conv1', 'relu'\] cannot be cut out of the stage: its nodes are not "
      r"a run of consecutive nodes")),
    (None, FUSED, OffloadSpec(recompute=(("maxpool", "layer1_0_conv1"),)),
     (r"^stage 0's offload recompute\[0\] \['maxpool', 'layer1_0_conv1'\] cuts into the spatial fused_groups\[0\], "
      r"fused_groups\[1\] \(a fused group runs as a whole\)")),
    (None, SpatialSpec(2, "vertical", "fused", 64, 64), OffloadSpec(swap=("relu",)),
     r"^stage 0's offload swap\[0\] \['relu'\] cuts into the spatial fused_groups\[0\]"),
    (_TwoLevels, _small((("strided", "same"),)), OffloadSpec(),
     r"^stage 0's spatial fused_groups\[0\] reads values tiled differently .* start the group where"),
    (_Twice, _small((("conv",),)), OffloadSpec(),
     r"^stage 0's layer 'conv' is called inside the spatial fused_groups\[0\] and outside every fused group"),
])
def test_groups_and_regions_the_runtime_cannot_run_are_refused_in_one_line(
        stem_stage: torch.fx.GraphModule, module: type[nn.Module] | None, spec: SpatialSpec,
        offload: OffloadSpec, message: str) -> None:
    graph = stem_stage if module is None else torch.fx.symbolic_trace(module())
    with pytest.raises(RuntimeSetupError, match=message) as refused:
        check_spatial_stage(graph, spec, offload, {}, stage=0)
    assert "\n" not in str(refused.value)
