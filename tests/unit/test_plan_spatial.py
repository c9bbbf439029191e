"""The spatial section of a plan: SpatialSpec's codec round trip and invariants, and the printed stage."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cost_models.errors import PlanFileError
from planner.plan import Plan, SpatialSpec
from planner.plan.spatial import HaloMode, Slicing
from tests.runtime_plans import RESNET, make_plan


@pytest.fixture(scope="module")
def tiled() -> Plan:
    spec = SpatialSpec(4, "square", "per-layer", height=64, width=64)
    return Plan.from_dict(json.loads(make_plan(RESNET, ["layer1_1_conv1"], schedule="1f1b", data_parallel=2,
                                               microbatches=2, spatial={0: spec})))


def test_the_spec_round_trips_exactly_and_decodes_fail_closed() -> None:
    spec = SpatialSpec(2, Slicing.VERTICAL, HaloMode.FUSED, 32, 48, fused_groups=(("conv1", "bn1"),))
    data = json.loads(json.dumps(dataclasses.asdict(spec)))
    assert SpatialSpec.from_dict(data, "s") == spec
    assert SpatialSpec.from_dict({k: v for k, v in data.items() if k != "fused_groups"}, "s").fused_groups == ()
    with pytest.raises(ValueError, match=r"s.slicing is 'diagonal'"):
        SpatialSpec.from_dict({**data, "slicing": "diagonal"}, "s")
    with pytest.raises(ValueError, match=r"s lacks fields \['height'\]"):
        SpatialSpec.from_dict({k: v for k, v in data.items() if k != "height"}, "s")


def test_a_tiled_plan_round_trips_numbers_tiles_and_prints_them(tiled: Plan) -> None:
    assert Plan.from_dict(json.loads(tiled.to_json())) == tiled
    assert tiled.layout.slot_ranks == (((0, 1, 2, 3), (8,)), ((4, 5, 6, 7), (9,)))
    assert tiled.cluster.gpus == 10 and len(tiled.programs) == 10
    assert "stage 0: 4 tiles (square), per-layer halos, ranks 0-3|4-7" in str(tiled)


def test_older_plans_without_a_spatial_section_still_load(tiled: Plan) -> None:
    plain = Plan.from_dict(json.loads(make_plan(RESNET, ["layer1_1_conv1"], schedule="gpipe")))
    data = json.loads(plain.to_json())
    del data["stages"][0]["spatial"]  # absent reads as null
    assert Plan.from_dict(data) == plain


@pytest.mark.parametrize(("edit", "message"), [
    ({"parts": 2}, r"stages\[0\].spatial.parts is 2 but the layout runs the part on \[4\] ranks"),
    ({"height": 1}, r"stages\[0\].spatial image 1x64 cannot be cut into 2x2 tiles"),
    ({"fused_groups": [["conv1"]]}, r"fused_groups is given but halo is 'per-layer'"),
    ({"halo": "fused", "fused_groups": [["nope"]]}, r"fused_groups names nodes \['nope'\]"),
])
def test_spatial_invariants_name_the_field(tiled: Plan, edit: dict, message: str) -> None:
    data = json.loads(tiled.to_json())
    data["stages"][0]["spatial"].update(edit)
    with pytest.raises(PlanFileError, match=message):
        Plan.from_dict(data)


def test_tiles_without_a_spatial_section_and_non_square_counts_are_refused(tiled: Plan) -> None:
    data = json.loads(tiled.to_json())
    data["stages"][0]["spatial"] = None
    with pytest.raises(PlanFileError, match=r"stages\[0\].spatial is null but the layout runs part 0 on \[4\]"):
        Plan.from_dict(data)
    assert SpatialSpec(3, "square", "per-layer", 9, 9).grid_shape == (0, 0)
