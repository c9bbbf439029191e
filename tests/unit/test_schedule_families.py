"""The schedule families beyond GPipe and 1F1B: literal programs, lowering and validation with skip
connections, step time against the textbook formula, and the in-flight profiles against the simulator."""

from __future__ import annotations

import dataclasses
import random

import pytest

from planner.plan import Layout
from planner.schedules import (
    Action,
    ActionKind,
    ScheduleError,
    SimCosts,
    SimEvent,
    SimResult,
    StageCosts,
    format_programs,
    generate,
    in_flight_profiles,
    lower,
    max_in_flight,
    simulate,
    validate,
)
from planner.schedules.generate import Schedule, gems_master, interleaved_one_f_one_b, wpipe, zb_h1
from planner.schedules.periods import Periods

STATIC = 50_000

# Megatron's order for 2 ranks x 2 virtual stages, M=4, worked by hand: rank 0 warms up with
# 2 (p - 1) + (v - 1) p = 4 forwards (stage 0, then stage 2, two micro-batches each), then F/B pairs.
INTERLEAVED_4x4 = (
    "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
    "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
)

# ZB-H1, 3 stages, M=4, by hand: stage s warms up with 3 - s forwards, then I of the oldest
# micro-batch, the W that leaves s pending, the next F; the last s Ws come at the end.
ZB_H1_3x4 = (
    "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
    "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
    "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
)

# GEMS-MASTER, 2 parts, M=4, by hand: slot 0 runs part 0 of copy A (stage 0, micro-batches 0, 1) and
# part 1 of copy B (stage 3, micro-batches 2, 3); replayed with F = 1, B = 2, each slot starts
# whichever of its two stages' next actions can start first (ties: a B first, then the lower stage).
GEMS_2x4 = (
    "0F0 0F1 3F2 3B2 0B0 0B1 3F3 3B3",
    "2F2 1F0 1B0 1F1 1B1 2F3 2B2 2B3",
)


def _rows(table: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(row.split()) for row in table)


def _edges(layout: Layout) -> frozenset[tuple[int, int]]:
    """Per model copy, a chain of parts with a skip connection from part 0 over two parts (where there
    are enough)."""
    parts = layout.num_parts
    return layout.copy_edges({(p, p + 1) for p in range(parts - 1)} | ({(0, 3)} if parts > 3 else set()))


def _simulate(schedule: Schedule, stages: tuple[StageCosts, ...]) -> SimResult:
    edges = _edges(schedule.layout)
    programs = schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, edges))
    validate(programs, schedule.layout, edges=edges)
    return simulate(programs, schedule.layout, SimCosts(stages, dict.fromkeys(edges, 0.0)))


def test_interleaved_programs_equal_a_literal_table() -> None:
    schedule = interleaved_one_f_one_b(4, 4)
    assert format_programs(schedule.programs) == _rows(INTERLEAVED_4x4)
    assert schedule.layout.stage_slot == (0, 1, 0, 1) and schedule.layout.world_size == 2
    assert generate("interleaved-1f1b", 4, 4, virtual_stages=2) == schedule


@pytest.mark.parametrize(("ranks", "virtual_stages", "num_microbatches"),
                         [(2, 2, 2), (2, 2, 6), (2, 3, 4), (4, 2, 8), (4, 3, 4), (3, 2, 9), (1, 3, 2)])
def test_interleaved_validates_and_takes_the_textbook_step(ranks: int, virtual_stages: int,
                                                           num_microbatches: int) -> None:
    # Equal stages, free transfers: each rank works M v (F + B) and waits (p - 1)(F + B) in all,
    # the 1F1B bubble divided by v (Narayanan et al. 2021, section 2.2).
    fwd_ms, bwd_ms = 1.0, 2.0
    schedule = interleaved_one_f_one_b(ranks * virtual_stages, num_microbatches, virtual_stages=virtual_stages)
    result = _simulate(schedule, (StageCosts(fwd_ms, bwd_ms, 1, STATIC),) * schedule.num_stages)
    per_rank = virtual_stages * (fwd_ms + bwd_ms)
    assert result.step_ms == pytest.approx(num_microbatches * per_rank + (ranks - 1) * per_rank / virtual_stages)
    assert result.busy_ms == pytest.approx([num_microbatches * per_rank] * ranks)


@pytest.mark.parametrize(("num_stages", "num_microbatches", "virtual_stages", "message"), [
    (4, 3, 2, ("interleaved-1f1b on 2 ranks needs a micro-batch count that is a multiple of 2, got 3; "
               "valid: 2, 4, 6, ...")),
    (6, 4, 4, ("interleaved-1f1b with 4 virtual stages per rank needs a stage count that is a multiple of 4, "
               "got 6; valid: 4, 8, 12, ...")),
])
def test_interleaved_counts_that_do_not_fit_are_one_line_errors(num_stages: int, num_microbatches: int,
                                                               virtual_stages: int, message: str) -> None:
    with pytest.raises(ValueError) as error:
        generate("interleaved-1f1b", num_stages, num_microbatches, virtual_stages=virtual_stages)
    assert str(error.value) == message


def test_zb_h1_programs_equal_a_literal_table() -> None:
    assert format_programs(zb_h1(3, 4).programs) == _rows(ZB_H1_3x4)
    assert generate("zb-h1", 3, 4) == zb_h1(3, 4)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 2), (2, 5), (3, 3), (4, 8), (5, 12)])
def test_zb_h1_validates_and_takes_the_zero_bubble_step(num_stages: int, num_microbatches: int) -> None:
    # F = I = W: each stage works M (F + I + W) and waits (S - 1)(F + I - W) (Qi et al. 2023, ZB-H1),
    # a third of 1F1B's (S - 1)(F + B); each stage holds up to S micro-batches (1F1B's peak).
    unit_ms = 1.0
    stages = (StageCosts(unit_ms, 2 * unit_ms, 1, STATIC, weight_grad_ms=unit_ms),) * num_stages
    result = _simulate(zb_h1(num_stages, num_microbatches), stages)
    assert result.step_ms == pytest.approx(3 * unit_ms * num_microbatches + (num_stages - 1) * unit_ms)
    one_f_one_b = _simulate(generate("1f1b", num_stages, num_microbatches), stages)
    assert one_f_one_b.step_ms - 3 * unit_ms * num_microbatches == pytest.approx(
        3 * (result.step_ms - 3 * unit_ms * num_microbatches))
    assert max_in_flight(zb_h1(num_stages, num_microbatches)) == (num_stages,) * num_stages


def test_what_splitting_a_backward_costs_beyond_it_lengthens_each_i() -> None:
    """A split backward's I takes bwd - W + split_extra_ms (W runs cold; ops making both gradients run in
    both): every rank works that much more per micro-batch, and the wait grows by it on every stage."""
    unit_ms, extra_ms, num_stages, num_microbatches = 1.0, 0.5, 3, 6
    stages = (StageCosts(unit_ms, 2 * unit_ms, 1, STATIC, weight_grad_ms=unit_ms, split_extra_ms=extra_ms),) * 3
    result = _simulate(zb_h1(num_stages, num_microbatches), stages)
    assert result.busy_ms == pytest.approx((num_microbatches * (3 * unit_ms + extra_ms),) * num_stages)
    # the zero-bubble wait (S - 1)(F + I - W), with I = 1 + extra
    assert result.step_ms == pytest.approx(num_microbatches * (3 * unit_ms + extra_ms)
                                           + (num_stages - 1) * (unit_ms + extra_ms))
    unsplit = _simulate(generate("1f1b", num_stages, num_microbatches), stages)  # B is one whole backward
    assert unsplit.busy_ms == pytest.approx((num_microbatches * 3 * unit_ms,) * num_stages)


def test_zb_h1_lowering_sends_after_i_and_reduces_after_the_last_w() -> None:
    schedule = zb_h1(2, 2, data_parallel=2)
    lowered = format_programs(lower(schedule.programs, schedule.layout, {(0, 1)}))
    assert lowered == (("0F0", "0SEND_F0>1", "0F1", "0SEND_F1>1", "0RECV_B0<1", "0I0", "0W0", "0RECV_B1<1",
                        "0I1", "0W1", "0ALLREDUCE", "0OPTIMIZER_STEP"),
                       ("1RECV_F0<0", "1F0", "1I0", "1SEND_B0>0", "1RECV_F1<0", "1F1", "1I1", "1SEND_B1>0",
                        "1W0", "1W1", "1ALLREDUCE", "1OPTIMIZER_STEP"))


@pytest.mark.parametrize(("swap", "message"), [
    ((2, 8), "W before its I: 1W0 runs before 1I0"),
    ((1, 2), "I before its F: 1I0 runs before 1F0"),
])
def test_a_split_backward_out_of_order_is_refused(swap: tuple[int, int], message: str) -> None:
    schedule = zb_h1(2, 2)
    lowered = list(lower(schedule.programs, schedule.layout, {(0, 1)}))
    program = list(lowered[1])
    program[swap[0]], program[swap[1]] = program[swap[1]], program[swap[0]]
    lowered[1] = tuple(program)
    with pytest.raises(ScheduleError, match=message):
        validate(tuple(lowered), schedule.layout)


def test_a_backward_given_both_whole_and_split_is_refused() -> None:
    schedule = zb_h1(1, 1)
    program = (*schedule.programs[0], Action(0, ActionKind.B, 0))
    with pytest.raises(ScheduleError, match="has a B and its halves I/W on rank 0"):
        validate((program,), schedule.layout)


def test_gems_master_programs_equal_a_literal_table() -> None:
    schedule = gems_master(2, 4)
    assert format_programs(schedule.programs) == _rows(GEMS_2x4)
    assert schedule.layout == Layout.mirrored(2) and generate("gems-master", 2, 4) == schedule


@pytest.mark.parametrize(("num_parts", "num_microbatches"), [(2, 2), (2, 6), (4, 2), (4, 8), (6, 6)])
def test_gems_master_validates_and_reduces_each_part_over_its_mirror(num_parts: int, num_microbatches: int) -> None:
    schedule = gems_master(num_parts, num_microbatches, data_parallel=2)
    layout = schedule.layout
    programs = layout.rank_programs(lower(schedule.programs, layout, _edges(layout)))
    validate(programs, layout, edges=_edges(layout))
    for rank, program in enumerate(programs):
        reduced = [action.stage for action in program if action.kind is ActionKind.ALLREDUCE]
        assert reduced == sorted(layout.stages_of_rank(rank), key=layout.part)  # one order of parts everywhere
    assert all(len(layout.part_ranks(part)) == 4 for part in range(num_parts))  # 2 copies x 2 replicas


def test_gems_master_fills_one_copys_bubble_with_the_other() -> None:
    # One micro-batch per copy on 4 equal parts: 1F1B over 2 micro-batches leaves 60 % of the ranks' time
    # idle; the mirror copy runs its forwards while the other's drain, and leaves 50 %.
    stage = StageCosts(1.0, 2.0, 1, STATIC)
    mirrored = _simulate(gems_master(4, 2), (stage,) * 8)
    pipeline = _simulate(generate("1f1b", 4, 2), (stage,) * 4)
    assert pipeline.bubble_fraction == pytest.approx(0.6) and mirrored.bubble_fraction == pytest.approx(0.5)


def test_gems_master_mirror_copies_wait_for_each_other_to_reduce() -> None:
    # Each part's all-reduce is a collective of its two copies, which reach it at different times (with
    # free all-reduces: the arrivals): both end A ms after the later arrival, and the rank that came
    # first waits. The first part reduced on every rank is part 0, so its arrivals do not depend on A.
    stages = tuple(StageCosts(1.0, 2.0, 1, STATIC) for _ in range(4))
    reducing = tuple(dataclasses.replace(stage, allreduce_ms=5.0) for stage in stages)
    free, paid = (_simulate(gems_master(2, 4), costs) for costs in (stages, reducing))
    layout = gems_master(2, 4).layout

    def part_0(result: SimResult) -> list[SimEvent]:
        return [e for e in result.events if e.action.endswith("ALLREDUCE") and layout.part(int(e.action[0])) == 0]
    arrivals = [event.start_ms for event in part_0(free)]
    assert len(arrivals) == 2 and arrivals[0] != arrivals[1]  # the copies come at different times
    assert [event.end_ms for event in part_0(paid)] == pytest.approx([max(arrivals) + 5.0] * 2)


@pytest.mark.parametrize(("num_parts", "num_microbatches", "message"), [
    (4, 3, ("gems-master splits the micro-batches between its 2 model copies and needs an even count, got 3; "
            "valid: 2, 4, 6, ...")),
    (3, 4, "gems-master pairs slot k with slot S-1-k and needs an even number of parts, got 3; valid: 2, 4, 6, ..."),
])
def test_gems_master_counts_that_do_not_fit_are_one_line_errors(num_parts: int, num_microbatches: int,
                                                                message: str) -> None:
    with pytest.raises(ValueError) as error:
        generate("gems-master", num_parts, num_microbatches)
    assert str(error.value) == message


def test_a_microbatch_through_a_part_twice_is_refused() -> None:
    layout = Layout.mirrored(2)  # both copies run every micro-batch: micro-batch 0 would count twice
    compute = tuple(tuple(Action(stage, kind, 0) for kind in (ActionKind.F, ActionKind.B)
                          for stage in layout.stages_on_slot(slot)) for slot in range(2))
    with pytest.raises(ScheduleError, match=r"micro-batch 0 runs part 0 on stages \[0, 2\]"):
        validate(lower(compute, layout, _edges(layout)), layout)


@pytest.mark.parametrize("schedule", [
    generate("gpipe", 3, 4), generate("1f1b", 4, 6), interleaved_one_f_one_b(4, 4), zb_h1(4, 6),
    gems_master(2, 4), gems_master(4, 8),
    interleaved_one_f_one_b(8, 8), interleaved_one_f_one_b(9, 6, virtual_stages=3), wpipe(4, 4), wpipe(6, 5)])
def test_in_flight_profiles_give_every_ranks_simulated_peak(schedule: Schedule) -> None:
    rng = random.Random(schedule.num_stages * 100 + schedule.num_microbatches)
    for _ in range(5):
        sizes = [rng.randint(1, 1000) for _ in range(schedule.num_stages)]
        costs = tuple(StageCosts(rng.uniform(0.5, 2), rng.uniform(1, 4), size, STATIC) for size in sizes)
        result = _simulate(schedule, costs)
        layout = schedule.layout
        for rank, peak in enumerate(result.peak_mem_bytes):
            slot = layout.place(rank).slot
            stages = layout.stages_on_slot(slot)
            static = STATIC * len(stages)
            assert peak == static + max(sum(held * sizes[stage] for held, stage in zip(vector, stages))
                                        for vector in in_flight_profiles(schedule)[slot])
    per_stage = max_in_flight(schedule)
    for slot, vectors in enumerate(in_flight_profiles(schedule)):
        stages = schedule.layout.stages_on_slot(slot)
        assert [max(vector[i] for vector in vectors) for i in range(len(stages))] == [per_stage[s] for s in stages]


# WPipe, 2 ranks x 2 groups, M=4, by hand from the rule: stage 0 (group 1) alternates B j with F j + 4 (all
# of its forwards run ahead: 4, 5, 6, 7 are the next step's 0..3), stage 1 with F j + 3 (F3 is this step's,
# 4..6 the next one's), stages 2 and 3 (group 2) run 1F1B in a 4-stage pipeline; each slot merges its
# two stages as a replay with F = 1, B = 2 starts them (ties: this step's work first, then a B, then the
# lower stage): e.g. slot 1 at t = 7 runs 1B0 (ready at 7, tied with 3F2) and then 1F3 (carried input) at 9.
WPIPE_4x4 = (
    "2F0 2F1 2B0 2F2 2B1 0B0 2F3 0F4 0B1 2B2 0F5 2B3 0B2 0F6 0B3 0F7",
    "3F0 3B0 3F1 3B1 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1F4 1B2 1F5 1B3 1F6",
)


def test_wpipe_programs_equal_a_literal_table_and_run_ahead_one_step() -> None:
    schedule = wpipe(4, 4)
    assert format_programs(schedule.programs) == _rows(WPIPE_4x4)
    periods = Periods.of(schedule.programs)
    assert periods.num_microbatches == 4
    assert periods.carried_on(0) == (0, 1, 2, 3) and periods.carried_on(1) == (0, 1, 2)
    assert periods.carried_on(2) == periods.carried_on(3) == ()  # the second group flushes every step
    assert max_in_flight(schedule) == (4, 3, 2, 1)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 1), (2, 3), (4, 2), (4, 8), (6, 6), (8, 16), (8, 3)])
def test_wpipe_validates_with_skips_and_its_memory_starts_with_the_carried_micro_batches(
        num_stages: int, num_microbatches: int) -> None:
    schedule = wpipe(num_stages, num_microbatches)
    stage = StageCosts(1.0, 2.0, 1, 0)
    result = _simulate(schedule, (stage,) * num_stages)
    ranks = num_stages // 2
    assert result.busy_ms == (num_microbatches * 2 * 3.0,) * ranks
    periods = Periods.of(schedule.programs)
    for rank, timeline in enumerate(result.memory_timeline):
        carried = sum(len(periods.carried_on(stage)) for stage in schedule.layout.stages_on_slot(rank))
        assert timeline[-1][1] == carried  # stationary: a step ends holding what the next one inherits
        assert result.peak_mem_bytes[rank] >= carried > 0  # held from the start (each rank has a first-group stage)


def test_wpipe_lowering_sends_carried_values_at_the_start_and_ahead_ones_within_the_first_group() -> None:
    schedule = wpipe(4, 4)
    edges = {(0, 1), (1, 2), (2, 3), (0, 3)}  # (0, 3): a skip from the first group into the second
    lowered = [[str(a) for a in program] for program in lower(schedule.programs, schedule.layout, edges)]
    # stage 1 (slot 1) carries micro-batches 0..2 from the last step: their activations leave first, as slot 0
    # takes them (the third after 3SEND_B0>2 on the same channel); micro-batch 3's leaves after its F
    assert lowered[1][:2] == ["1SEND_F0>2", "1SEND_F1>2"]
    assert lowered[1].index("3SEND_B0>2") < lowered[1].index("1SEND_F2>2") < lowered[1].index("1F3")
    assert lowered[1].index("1F3") < lowered[1].index("1SEND_F3>2")
    # stage 0's carried skip values to stage 3 go at slot 0's start too; ahead ones stay for the next step
    assert [a for a in lowered[0] if a.startswith("0SEND_F") and a.endswith(">3")] == [
        "0SEND_F0>3", "0SEND_F1>3", "0SEND_F2>3", "0SEND_F3>3"]
    assert "0SEND_F4>1" in lowered[0] and "1RECV_F4<0" in lowered[1]  # ahead, within the first group
    validate(schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, edges)), schedule.layout,
             edges=edges)


def test_programs_that_run_ahead_wrongly_are_refused() -> None:
    layout = Layout.pipeline(1)
    two_ahead = (tuple(Action.parse(a) for a in ("0B0", "0F1", "0B1", "0F4")),)
    with pytest.raises(ScheduleError, match=r"runs more than one step ahead"):
        validate(two_ahead, layout)
    again = (tuple(Action.parse(a) for a in ("0F0", "0B0", "0F1", "0B1", "0F2")),)  # F0 carried and run
    with pytest.raises(ScheduleError, match=r"micro-batch 0's F on stage 0 ran in the previous step"):
        validate(again, layout)
    missing = (tuple(Action.parse(a) for a in ("0B0", "0F1", "0B1")),)  # nothing runs ahead: F0 is missing
    with pytest.raises(ScheduleError, match=r"missing F: rank 0 runs stage 0 but has no F for micro-batch 0"):
        validate(missing, layout)


def test_wpipe_needs_an_even_part_count() -> None:
    with pytest.raises(ValueError, match=r"wpipe splits the parts into two groups .* got 3; valid: 2, 4, 6"):
        wpipe(3, 4)


def _tiny_plan(schedule: str, stages: int):  # noqa: ANN202 - a Plan
    import json

    from planner.plan import Plan
    from tests.runtime_plans import GPT, make_plan

    starts = ["blocks_0_attn_qkv", "blocks_1_ln_1", "blocks_1_attn_qkv"][:stages - 1]
    return Plan.from_dict(json.loads(make_plan(GPT, starts, schedule=schedule, microbatches=4)))


@pytest.mark.parametrize(("kind", "options", "world"), [
    ("interleaved-1f1b", {"virtual_stages": 2}, 2), ("zb-h1", {}, 4), ("gems-master", {}, 4)])
def test_reschedule_makes_a_checked_plan_of_every_family(kind: str, options: dict, world: int) -> None:
    """Through planner.manual.reschedule: the layout, programs and predictions of the family, and a
    plan file that round-trips and passes its invariants."""
    from planner.manual import reschedule
    from planner.plan import Plan
    from planner.simulation import simulate_plan

    plan = reschedule(_tiny_plan("gpipe", 4), kind, **options)
    assert plan.schedule.kind.value == kind and plan.layout.world_size == world == plan.cluster.gpus
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.predicted.step_ms == pytest.approx(simulate_plan(plan).step_ms)
    # its why-line says what was done, not the first plan's reason (a rescheduled plan printed "gpipe has the
    # lowest step" beside its own step)
    assert plan.solver.why.startswith(f"schedule {kind} set by hand") and plan.solver.runner_up is None
    assert "gpipe" not in plan.solver.why and not plan.solver.binding


@pytest.mark.parametrize(("kind", "options", "message"), [
    ("interleaved-1f1b", {"virtual_stages": 2}, "interleaved-1f1b:"),
    ("gems-master", {}, "gems-master:"),
])
def test_reschedule_refuses_what_the_family_cannot_use_in_one_line(kind: str, options: dict, message: str) -> None:
    from cost_models.errors import InvalidArgument
    from planner.manual import reschedule

    with pytest.raises(InvalidArgument, match=message) as caught:
        reschedule(_tiny_plan("gpipe", 3), kind, **options)  # 3 parts: neither 3 x ranks nor even
    assert "\n" not in str(caught.value)


def test_rescheduled_to_gems_master_each_part_all_reduces_over_its_mirror_copy() -> None:
    """A pipeline plan has no all-reduce; its GEMS-MASTER plan sums each part's gradients with the mirror
    copy: by hand, a two-rank ring on the device's collective link (2 alphas + bytes / beta), costed in
    the prediction (the step outgrows the same programs with the all-reduces free). The bytes are the part's
    gradients but the tied embedding's, which its own sum over both ranks carries."""
    from cost_models.devices import get_device
    from planner.manual import reschedule
    from planner.simulation import simulate_plan

    base = _tiny_plan("gpipe", 2)
    link = get_device("V100-16GB").intra_node  # its ranks share a node: NVLink
    gems = reschedule(base, "gems-master")
    assert [stage.predicted.allreduce_ms for stage in base.stages] == [0.0, 0.0]
    (embedding,) = gems.tied_sums
    assert embedding.parts == (0, 1) and embedding.nbytes == 512 * 64 * 8
    for stage in gems.stages:
        grad_bytes = stage.predicted.grad_bytes - embedding.nbytes
        assert grad_bytes > 0
        expected = 2 * link.latency_us / 1e3 + grad_bytes / (link.bandwidth_gb_per_s * 1e9) * 1e3
        assert stage.predicted.allreduce_ms == pytest.approx(expected)
    free = dataclasses.replace(gems, stages=tuple(dataclasses.replace(
        stage, predicted=dataclasses.replace(stage.predicted, allreduce_ms=0.0)) for stage in gems.stages))
    assert gems.predicted.step_ms > simulate_plan(free).step_ms
