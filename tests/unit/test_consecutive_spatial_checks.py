"""Consecutive spatial stages: what the runtime accepts (leading spatial stages, each on its own slot,
then ordinary ones), one-line refusals otherwise, and the tile grid of every image a later spatial
stage receives (each over its own size; the section's height and width are its first input's)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cost_models.errors import RuntimeSetupError
from planner.plan import Plan, SpatialSpec
from runtime import checks
from runtime.build import rebuild_model, split_stages, trace_checked
from runtime.dataflow import Dataflow, dataflow
from runtime.spatial import TileGrid
from runtime.tiles import input_grids
from runtime.values import value_specs
from tests.runtime_plans import RESNET, make_plan

SQUARE, STRIPS = SpatialSpec(4, "square", "per-layer", 64, 64), SpatialSpec(2, "vertical", "per-layer", 16, 16)


def _plan(stage_starts: list[str], spatial: dict[int, SpatialSpec]) -> Plan:
    return Plan.from_dict(json.loads(make_plan(RESNET, stage_starts, schedule="1f1b", microbatches=2,
                                               spatial=spatial)))


def _flow(plan: Plan) -> Dataflow:
    model = rebuild_model(plan)
    traced = trace_checked(model, plan)
    inputs = [(meta.shape, getattr(torch, meta.dtype)) for meta in plan.model.example_inputs]
    specs = value_specs(traced, inputs, plan.training.micro_batch_size)
    return dataflow(traced, split_stages(traced, model, plan), plan.part_of(), specs)


def test_leading_spatial_stages_then_an_ordinary_one_are_executed() -> None:
    checks.check_executable(_plan(["layer2_0_conv1", "layer3_0_conv1"], {0: SQUARE, 1: STRIPS}))


@pytest.mark.parametrize(("stage_starts", "spatial", "message"), [
    (["layer2_0_conv1", "layer3_0_conv1"], {1: STRIPS},
     r"stage 1 runs on spatial tiles after stage 0, which does not; .* re-plan with the spatial stages first"),
    (["layer2_0_conv1"], {0: SQUARE, 1: STRIPS},
     r"stage 0 runs on spatial tiles and so does every later stage up to the last \(1\); .* non-spatial last stage"),
])
def test_other_spatial_stages_are_refused_in_one_line(stage_starts: list[str], spatial: dict[int, SpatialSpec],
                                                     message: str) -> None:
    with pytest.raises(RuntimeSetupError, match=f"^{message}$") as refused:
        checks.check_executable(_plan(stage_starts, spatial))
    assert "\n" not in str(refused.value)


def test_a_later_stage_tiles_each_image_over_its_own_size_and_checks_its_first() -> None:
    horizontal = SpatialSpec(2, "horizontal", "per-layer", 8, 8)
    plan = _plan(["layer2_0_conv1", "layer2_0_bn2", "layer2_1_conv1"],
                 {0: dataclasses.replace(horizontal, height=64, width=64), 1: STRIPS, 2: horizontal})
    flow = _flow(plan)
    # stage 2 reads conv2's output first (its bn2), then layer1's output skipping stage 1 (the shortcut)
    assert input_grids(plan, 2, flow) == {"layer2_0_conv2": TileGrid.build(2, "horizontal", 8, 8),
                                          "layer1_2_relu3": TileGrid.build(2, "horizontal", 16, 16)}
    assert input_grids(plan, 1, flow) == {"layer1_2_relu3": TileGrid.build(2, "vertical", 16, 16)}
    wrong = dataclasses.replace(plan, stages=(*plan.stages[:2], dataclasses.replace(
        plan.stages[2], spatial=dataclasses.replace(horizontal, height=16, width=16)), plan.stages[3]))
    with pytest.raises(RuntimeSetupError, match=r"^stage 2 tiles a 16x16 image but its first input is layer2_0_conv2 "
                                                r"of shape \(2, 8, 8, 8\); make .* first \(N, C, H, W\) input$"):
        input_grids(wrong, 2, flow)
