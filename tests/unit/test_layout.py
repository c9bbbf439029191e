"""The Layout: constructors and lookups against hand-written tables, its checks, and a layout with a stage
spanning two ranks and a rank holding two stages accepted by the validator, the simulator and the
runtime's set-up checks."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cost_models.errors import RuntimeSetupError
from planner.plan import Layout, OffloadSpec, Plan, SpatialSpec, StateTier
from planner.plan.layout import layout_from_dict
from planner.schedules import (
    Action,
    ActionKind,
    SimCosts,
    StageCosts,
    format_programs,
    lower,
    parse_programs,
    simulate,
    validate,
)
from runtime import checks
from tests.runtime_plans import GPT, make_plan


def test_pipeline_places_stage_s_of_replica_r_on_rank_s_times_d_plus_r() -> None:
    layout = Layout.pipeline(3, data_parallel=2)
    assert [[layout.ranks_of(stage, replica) for replica in range(2)] for stage in range(3)] == [
        [(0,), (1,)], [(2,), (3,)], [(4,), (5,)]]
    assert [layout.place(rank) for rank in (0, 5)] == [layout.place(0), layout.place(5)]
    assert (layout.place(3).replica, layout.place(3).slot, layout.place(3).tile) == (1, 1, 0)
    assert layout.part_ranks(1) == (2, 3) and layout.world_size == 6 and layout.is_pipeline
    assert layout.describe_ranks(2) == "4,5"
    assert Layout.pipeline(1, 8).describe_ranks(0) == "0..7"


def test_slots_with_tiles_and_several_stages() -> None:
    # Stage 0 split into two spatial tiles on its own slot; stages 1 and 2 share slot 1 (looped).
    layout = Layout.replicated((0, 1, 1), data_parallel=2, tiles=(2, 1))
    assert layout.slot_ranks == (((0, 1), (4,)), ((2, 3), (5,)))
    assert layout.ranks_of(0, 1) == (2, 3) and layout.ranks_of(2, 0) == (4,)
    assert layout.stages_of_rank(4) == (1, 2) and layout.stages_of_rank(3) == (0,)
    assert (layout.place(3).replica, layout.place(3).slot, layout.place(3).tile) == (1, 0, 1)
    assert layout.virtual_stage(2) == 1 and layout.virtual_stage(1) == 0
    assert layout.part_ranks(0) == (0, 1, 2, 3)  # the gradient group spans tiles and replicas
    assert layout.channels(0, 1, replica=1) == ((2, 5), (3, 5))  # the join: every tile to the next slot
    assert not layout.is_pipeline and layout.describe_ranks(0) == "0-1|2-3"
    assert layout.rank_programs(("slot 0", "slot 1")) == ("slot 0",) * 4 + ("slot 1",) * 2


def test_mirrored_copies_of_a_part() -> None:
    # Two copies of a 2-part model in opposite directions on 2 slots (the GEMS placement).
    layout = Layout(stage_part=(0, 1, 0, 1), stage_slot=(0, 1, 1, 0), slot_ranks=(((0,), (1,)),))
    assert layout.stages_of_part(0) == (0, 2) and layout.part_ranks(0) == (0, 1)
    assert layout.stages_of_rank(0) == (0, 3) and layout.num_parts == 2 and layout.num_stages == 4


@pytest.mark.parametrize(("fields", "message"), [
    (dict(stage_part=(0, 2), stage_slot=(0, 1), slot_ranks=(((0,), (1,)),)), "every part 0..P-1"),
    (dict(stage_part=(0, 1), stage_slot=(0, 2), slot_ranks=(((0,), (1,), (2,)),)), "every slot 0..2"),
    (dict(stage_part=(0, 1), stage_slot=(0, 1), slot_ranks=(((0,), (0,)),)), r"ranks \[0, 0\] must be 0..1"),
    (dict(stage_part=(0, 1), stage_slot=(0, 1), slot_ranks=(((0,), (1,)), ((2, 3), (4,)))), "same slots"),
    (dict(stage_part=(0,), stage_slot=(0, 1), slot_ranks=(((0,), (1,)),)), "a part and a slot for each"),
])
def test_inconsistent_layouts_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Layout(**fields)


def test_lookups_out_of_range_name_the_value() -> None:
    layout = Layout.pipeline(2)
    with pytest.raises(ValueError, match="stage 2 is out of range"):
        layout.ranks_of(2, 0)
    with pytest.raises(ValueError, match="replica 1 is out of range"):
        layout.ranks_of(0, 1)
    with pytest.raises(ValueError, match="rank 7 is not in this layout"):
        layout.place(7)


def test_json_round_trip_and_decoding_errors() -> None:
    layout = Layout.replicated((0, 1, 1), data_parallel=2, tiles=(2, 1))
    data = json.loads(json.dumps(dataclasses.asdict(layout)))
    assert layout_from_dict(data, "layout") == layout
    with pytest.raises(ValueError, match=r"layout.slot_ranks\[0\]\[0\]\[1\] must be an integer"):
        layout_from_dict({**data, "slot_ranks": [[[0, "1"], [4]], [[2, 3], [5]]]}, "layout")
    with pytest.raises(ValueError, match=r"layout has unknown fields \['ranks'\]"):
        layout_from_dict({**data, "ranks": []}, "layout")


@pytest.fixture(scope="module")
def spanning_plan() -> Plan:
    """A real 3-part GPT plan re-placed: part 0 split over ranks 0 and 1, parts 1 and 2 both on rank 2."""
    plan = Plan.from_dict(json.loads(make_plan(GPT, ["blocks_0_ln_1", "blocks_1_ln_1"], schedule="gpipe")))
    layout = Layout.replicated((0, 1, 1), tiles=(2, 1))
    microbatches = range(plan.training.num_microbatches)
    compute = (tuple(Action(0, kind, m) for kind in (ActionKind.F, ActionKind.B) for m in microbatches),
               tuple(Action(stage, ActionKind.F, m) for stage in (1, 2) for m in microbatches)
               + tuple(Action(stage, ActionKind.B, m) for stage in (2, 1) for m in microbatches))
    edges = {(t.src_stage, t.dst_stage) for t in plan.transfers}
    programs = layout.rank_programs(lower(compute, layout, edges))
    stages = (dataclasses.replace(plan.stages[0], spatial=SpatialSpec(2, "vertical", "per-layer", 32, 32)),
              *plan.stages[1:])
    return dataclasses.replace(plan, layout=layout, programs=format_programs(programs), stages=stages,
                               cluster=dataclasses.replace(plan.cluster, gpus=3))


def test_the_validator_and_the_simulator_accept_a_spanning_stage_and_a_shared_rank(spanning_plan: Plan) -> None:
    layout, programs = spanning_plan.layout, parse_programs(spanning_plan.programs)
    validate(programs, layout, edges={(t.src_stage, t.dst_stage) for t in spanning_plan.transfers})
    assert programs[0] == programs[1]  # both tiles run stage 0's program
    held = spanning_plan.training.num_microbatches
    sends = [str(a) for a in programs[0] if a.kind is ActionKind.SEND_F]
    assert sends == [f"0SEND_F{m}>1" for m in range(held)]  # each tile sends its share to rank 2
    assert str(programs[2][0]) == "1RECV_F0<0"  # which takes one message from each tile (a join)
    stages = tuple(StageCosts(1.0 + stage, 2.0, 10 ** stage, 1000 * (stage + 1)) for stage in range(3))
    result = simulate(programs, layout, SimCosts(stages, {(0, 1): 0.5}))
    assert result.peak_mem_bytes == (1000 + held, 1000 + held, 2000 + 3000 + held * (10 + 100))
    joins = [e for e in result.events if e.rank == 2 and e.action == "1RECV_F0<0"]
    assert len(joins) == 1 and joins[0].end_ms == pytest.approx(1.0 + 0.5)  # tile's 0F0, then the transfer
    assert sum(e.action == "0SEND_F0>1" for e in result.events) == 2


def test_the_runtime_set_up_checks_accept_it_and_name_what_it_does_not_execute_yet(spanning_plan: Plan) -> None:
    checks.check_plan(spanning_plan)
    checks.check_world_size(spanning_plan, 3)
    assert checks.my_stages(spanning_plan, 2) == ((1, 2), 0) and checks.my_stages(spanning_plan, 1) == ((0,), 0)
    assert all(checks.rank_program(spanning_plan, rank) for rank in range(3))
    checks.check_executable(spanning_plan)  # a leading spatial stage is executed today
    def offloaded(spec: OffloadSpec) -> Plan:
        stages = (dataclasses.replace(spanning_plan.stages[0], offload=spec), *spanning_plan.stages[1:])
        return dataclasses.replace(spanning_plan, stages=stages)

    checks.check_executable(offloaded(OffloadSpec(recompute=(("wte",),), swap=("drop",))))  # run on tiles
    checks.check_executable(offloaded(OffloadSpec(recompute=(("wte",),), zero_stage=1)))  # sharded over the tiles
    checks.check_executable(offloaded(OffloadSpec(optimizer_state=StateTier.HOST)))
    unspatial = (dataclasses.replace(spanning_plan.stages[0], spatial=None), *spanning_plan.stages[1:])
    looped = dataclasses.replace(spanning_plan, layout=Layout.replicated((0, 1, 1)), stages=unspatial,
                                 programs=spanning_plan.programs[1:], cluster=spanning_plan.cluster.__class__(
                                     2, 2, spanning_plan.cluster.device, spanning_plan.cluster.mem_bytes))
    checks.check_plan(looped)
    checks.check_executable(looped)  # a rank holding two stages is executed today


def test_a_program_that_would_hang_is_refused_before_any_work(spanning_plan: Plan) -> None:
    programs = [list(program) for program in spanning_plan.programs]
    programs[1].remove("0SEND_F0>1")  # tile 1 never sends micro-batch 0 forward
    broken = dataclasses.replace(spanning_plan, programs=tuple(tuple(p) for p in programs))
    with pytest.raises(RuntimeSetupError, match="the plan's programs cannot run"):
        checks.check_plan(broken)
