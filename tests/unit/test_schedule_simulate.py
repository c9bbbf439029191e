"""planner.schedules.simulate: step time, bubble and memory against hand-computed values."""

from __future__ import annotations

import pytest

from planner.plan import Layout, TiedSum
from planner.schedules.actions import parse_programs
from planner.schedules.generate import generate, max_in_flight, weight_grads_waiting
from planner.schedules.lower import lower
from planner.schedules.simulate import SimCosts, SimResult, StageCosts, simulate
from planner.schedules.validate import ScheduleError

ACT, STATIC = 1000, 50_000


def _chain(num_stages: int) -> dict[tuple[int, int], float]:
    return {(stage, stage + 1): 0.0 for stage in range(num_stages - 1)}


def _run(kind: str, stages: tuple[StageCosts, ...], num_microbatches: int, transfer_ms: float = 0.0,
         data_parallel: bool = False) -> SimResult:
    schedule = generate(kind, len(stages), num_microbatches, data_parallel=2 if data_parallel else 1)
    edges = {edge: transfer_ms for edge in _chain(len(stages))}
    programs = schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, edges))
    return simulate(programs, schedule.layout, SimCosts(stages, edges))


def _equal(num_stages: int, fwd_ms: float = 1.5, **extra: float) -> tuple[StageCosts, ...]:
    return tuple(StageCosts(fwd_ms, 2 * fwd_ms, ACT, STATIC, **extra) for _ in range(num_stages))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages", range(1, 6))
@pytest.mark.parametrize("num_microbatches", range(1, 9))
def test_equal_stages_without_transfers(kind: str, num_stages: int, num_microbatches: int) -> None:
    result = _run(kind, _equal(num_stages), num_microbatches)
    slots = num_microbatches + num_stages - 1
    assert result.step_ms == pytest.approx(slots * 3 * 1.5)
    assert result.bubble_fraction == pytest.approx((num_stages - 1) / slots)
    assert result.busy_ms == pytest.approx([num_microbatches * 4.5] * num_stages)


@pytest.mark.parametrize("num_stages", range(1, 6))
@pytest.mark.parametrize("num_microbatches", [1, 3, 8])
def test_gpipe_transfers_add_two_hops_per_edge(num_stages: int, num_microbatches: int) -> None:
    free = _run("gpipe", _equal(num_stages, fwd_ms=1.0), num_microbatches)
    paid = _run("gpipe", _equal(num_stages, fwd_ms=1.0), num_microbatches, transfer_ms=0.25)
    assert paid.step_ms == pytest.approx(free.step_ms + 2 * (num_stages - 1) * 0.25)


def test_transfers_on_one_link_are_serialised() -> None:
    # GPipe, S=2, F=1, B=2, transfer 2 ms each way, M=3. Sends at t=1,2,3 share the link 0->1:
    # arrivals 3,5,7, so stage 1 runs F at [3,4], [5,6], [7,8] and B at [8,10], [10,12], [12,14].
    # Gradients leave at 10,12,14 and arrive 12,14,16 (the link 1->0 is free each time);
    # stage 0 runs B at [12,14], [14,16], [16,18]: the step takes 18 ms.
    result = _run("gpipe", _equal(2, fwd_ms=1.0), 3, transfer_ms=2.0)
    assert result.step_ms == pytest.approx(18.0)
    sends = [(e.action, e.start_ms, e.end_ms) for e in result.events if "SEND_F" in e.action]
    assert sends == [("0SEND_F0>1", 1.0, 3.0), ("0SEND_F1>1", 3.0, 5.0), ("0SEND_F2>1", 5.0, 7.0)]


def test_posting_a_message_costs_both_ends_but_a_receive_posts_while_it_waits() -> None:
    # GPipe, S=2, F=1, B=2, M=2, transfers free, each post 0.5 ms. Rank 0: F0 [0,1], posts SEND_F0 [1,1.5]
    # (arrives 1.5), F1 [1.5,2.5], posts SEND_F1 [2.5,3]. Rank 1 posts RECV_F0 at 0 (done 0.5, waits to
    # 1.5), F0 [1.5,2.5], RECV_F1 posted by 3 = its arrival, F1 [3,4], B0 [4,6], SEND_B0 [6,6.5], B1 [6.5,8.5],
    # SEND_B1 [8.5,9]. Rank 0 posts RECV_B0 (3.5) and waits to 6.5, B0 [6.5,8.5], RECV_B1 [8.5,9], B1 [9,11].
    schedule = generate("gpipe", 2, 2)
    programs = schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, _chain(2)))
    posted = simulate(programs, schedule.layout, SimCosts(_equal(2, fwd_ms=1.0), _chain(2), {(0, 1): 0.5}))
    free = simulate(programs, schedule.layout, SimCosts(_equal(2, fwd_ms=1.0), _chain(2)))
    assert (free.step_ms, posted.step_ms) == pytest.approx((9.0, 11.0))
    assert posted.busy_ms == free.busy_ms == pytest.approx((6.0, 6.0))  # posting is not compute
    assert posted.bubble_fraction == pytest.approx(1 - 12 / 22)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_unequal_two_stage_example(kind: str) -> None:
    # F0=1, B0=2, F1=3, B1=6, M=4, free transfers. Stage 1 is the bottleneck: once its first
    # input arrives at t=1 it is never idle in either schedule.
    # GPipe: stage 1 forwards [1,4] [4,7] [7,10] [10,13], backwards [13,19] [19,25] [25,31] [31,37];
    #   stage 0's last backward waits for the gradient at 37 and runs [37,39].
    # 1F1B: stage 1 runs F0 [1,4] B0 [4,10] F1 [10,13] B1 [13,19] F2 [19,22] B2 [22,28] F3 [28,31]
    #   B3 [31,37] (each input was sent long before: stage 0 F2 runs [12,13], F3 [21,22]);
    #   stage 0 again ends with B3 [37,39].
    # Step = F0 + 4 * (F1 + B1) + B0 = 1 + 36 + 2 = 39 ms; busy = 4*3 + 4*9 = 48 of 2*39 = 78.
    stages = (StageCosts(1.0, 2.0, ACT, STATIC), StageCosts(3.0, 6.0, ACT, STATIC))
    result = _run(kind, stages, 4)
    assert result.step_ms == pytest.approx(39.0)
    assert result.busy_ms == pytest.approx([12.0, 36.0])
    assert result.bubble_fraction == pytest.approx(1 - 48 / 78)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(1, 1), (3, 2), (4, 4), (4, 7), (6, 3)])
def test_peak_memory_is_static_plus_in_flight_activations(kind: str, num_stages: int,
                                                          num_microbatches: int) -> None:
    result = _run(kind, _equal(num_stages), num_microbatches, transfer_ms=0.5)
    formula = [num_microbatches if kind == "gpipe" else min(num_microbatches, num_stages - stage)
               for stage in range(num_stages)]
    assert result.peak_mem_bytes == tuple(STATIC + held * ACT for held in formula)
    assert result.peak_mem_bytes == tuple(STATIC + held * ACT
                                          for held in max_in_flight(generate(kind, num_stages, num_microbatches)))
    for timeline in result.memory_timeline:
        assert timeline[0] == (0.0, STATIC) and timeline[-1][1] == STATIC
        assert [t for t, _ in timeline] == sorted(t for t, _ in timeline)


@pytest.mark.parametrize(("kind", "num_stages", "num_microbatches"), [("gpipe", 1, 2), ("gpipe", 3, 4),
                                                                      ("1f1b", 4, 4), ("1f1b", 4, 6)])
def test_gradients_exist_from_the_first_backward_to_the_optimizer_step(kind: str, num_stages: int,
                                                                       num_microbatches: int) -> None:
    """Of each stage's static bytes S, G are gradients: absent until its first B ends, where that backward's
    activations go (their exchange peaks at one end), freed by the optimizer step. By hand, with w the
    micro-batches a stage holds at most: GPipe and 1F1B without refills peak at max(S - G + w A, S + (w - 1) A)
    (all forwards before the first backward ends); 1F1B with more micro-batches than w refills its window
    after that backward, with gradients: S + w A."""
    grads = 30_000
    result = _run(kind, tuple(StageCosts(1.5, 3.0, ACT, STATIC, grad_bytes=grads, optimizer_ms=0.5)
                              for _ in range(num_stages)), num_microbatches)
    held = max_in_flight(generate(kind, num_stages, num_microbatches))
    for stage, timeline in enumerate(result.memory_timeline):
        w = held[stage]
        refills = kind == "1f1b" and num_microbatches > w
        expected = STATIC + w * ACT if refills else max(STATIC - grads + w * ACT, STATIC + (w - 1) * ACT)
        assert result.peak_mem_bytes[stage] == expected
        assert timeline[0] == (0.0, STATIC - grads) and timeline[-1][1] == STATIC - grads


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 2), (2, 8), (3, 6), (4, 8)])
@pytest.mark.parametrize("relief", [0, 300])
def test_a_split_backward_holds_what_its_input_gradient_kept_until_its_weight_gradient(
        num_stages: int, num_microbatches: int, relief: int) -> None:
    """ZB-H1: a later stage's I keeps K bytes per micro-batch for its W, from I's end to W's end, and from
    an I's end until the rank's next F or I its largest transient (R of its static bytes) is not held. By
    hand, with h the micro-batches it holds at most and w the Ws waiting at most (ZB-H1 reaches both at
    once, after an I; a forward runs with one W fewer waiting): the peak is max(S + h A + (w - 1) K,
    S - R + h A + w K). The first stage keeps nothing (its W is its whole backward)."""
    kept = 700
    stages = tuple(StageCosts(1.5, 3.0, ACT, STATIC, weight_grad_ms=1.0,
                              split_kept_bytes=kept if stage else 0, split_relief_bytes=relief if stage else 0)
                   for stage in range(num_stages))
    result = _run("zb-h1", stages, num_microbatches)
    schedule = generate("zb-h1", num_stages, num_microbatches)
    held, (waiting, _) = max_in_flight(schedule), weight_grads_waiting(schedule)
    for stage, timeline in enumerate(result.memory_timeline):
        h, w = held[stage], waiting[stage]
        expected = STATIC + h * ACT if stage == 0 else max(STATIC + h * ACT + (w - 1) * kept,
                                                           STATIC - relief + h * ACT + w * kept)
        assert result.peak_mem_bytes[stage] == expected
        assert timeline[-1][1] == STATIC


def test_every_tile_rank_of_a_spatial_stage_allocates_and_frees_its_own_gradients() -> None:
    """Stage 0 on 2 tile ranks, GPipe, 2 micro-batches: each tile rank peaks at max(S - G + 2A, S + A) and ends
    the step at S - G, as the stage's only rank would."""
    grads = 30_000
    schedule = generate("gpipe", 2, 2, tiles=[2, 1])
    edges = _chain(2)
    programs = schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, edges))
    result = simulate(programs, schedule.layout,
                      SimCosts(tuple(StageCosts(1.5, 3.0, ACT, STATIC, grad_bytes=grads) for _ in range(2)), edges))
    for rank in schedule.layout.ranks_of(0, 0):
        assert result.peak_mem_bytes[rank] == max(STATIC - grads + 2 * ACT, STATIC + ACT)
        assert result.memory_timeline[rank][-1][1] == STATIC - grads


def test_allreduce_and_optimizer_step_end_the_step() -> None:
    stages = _equal(3, fwd_ms=1.0, allreduce_ms=4.0, optimizer_ms=0.5)
    result = _run("1f1b", stages, 4, data_parallel=True)
    assert result.step_ms == pytest.approx((4 + 3 - 1) * 3.0 + 4.0 + 0.5)
    assert result.busy_ms == pytest.approx([4 * 3.0 + 0.5] * 6)  # the all-reduce is not busy compute
    last = [e for e in result.events if e.rank == 0][-2:]
    assert [(e.action, e.lane, e.end_ms - e.start_ms) for e in last] == [
        ("0ALLREDUCE", "comm", 4.0), ("0OPTIMIZER_STEP", "compute", 0.5)]


@pytest.mark.parametrize(("overlap", "allreduce_ms", "step_ms"), [
    (0.0, 3.0, 6.0 + 3.0),  # one bucket: it starts when the last backward ends
    (0.5, 3.0, max(4.0 + 1.5, 6.0) + 1.5),  # half during the last backward (4..6), the last half after it
    (0.5, 8.0, max(4.0 + 4.0, 6.0) + 4.0),  # the early buckets outlast the backward
    (0.9, 1.0, max(4.0 + 0.9, 6.0) + 0.1),
])
def test_an_allreduce_in_buckets_overlaps_the_last_backward(overlap: float, allreduce_ms: float,
                                                             step_ms: float) -> None:
    """Data parallel, one stage, two micro-batches (F 1, B 2): the last B runs from 4 to 6; the buckets
    before the last start with it, the last when it ends (DDP's overlap)."""
    layout = Layout.pipeline(1, data_parallel=2)
    programs = layout.rank_programs(parse_programs([["0F0", "0F1", "0B0", "0B1", "0ALLREDUCE", "0OPTIMIZER_STEP"]]))
    stage = StageCosts(1.0, 2.0, 0, 0, allreduce_ms=allreduce_ms, allreduce_overlap=overlap)
    result = simulate(programs, layout, SimCosts((stage,), {}))
    assert result.step_ms == pytest.approx(step_ms)
    reduce = next(e for e in result.events if e.action == "0ALLREDUCE" and e.rank == 0)
    assert reduce.lane == "comm" and reduce.end_ms == pytest.approx(step_ms)


def test_the_prediction_says_which_stages_overlap_their_allreduce() -> None:
    from planner.plan import OffloadSpec, StagePrediction

    big = StagePrediction(1.0, 2.0, param_bytes=60 * 2**20, static_bytes=0, activation_bytes=0, allreduce_ms=5.0)
    assert big.allreduce_overlap(OffloadSpec(), False, "nccl") == pytest.approx(51 / 60)  # 1 + 25 + 25 MiB first
    assert big.allreduce_overlap(OffloadSpec(zero_stage=2), False, "nccl") == 0.0  # a reduce-scatter after it
    assert big.allreduce_overlap(OffloadSpec(), True, "nccl") == 0.0  # WPipe's stashed versions, ZB-H1's W
    assert big.allreduce_overlap(OffloadSpec(), False, "gloo") == 0.0  # a CPU rank's one core does it all
    small = StagePrediction(1.0, 2.0, param_bytes=2**19, static_bytes=0, activation_bytes=0, allreduce_ms=5.0)
    assert small.allreduce_overlap(OffloadSpec(), False, "nccl") == 0.0  # one bucket


def test_a_tied_sum_waits_for_every_copy_before_the_first_optimizer_step() -> None:
    """GPipe, 2 stages, 2 micro-batches, F 1, B 2, free transfers: stage 1's backwards end at 7, stage 0's at 9.
    A weight tied across both parts (a GPT's embedding and head) has its gradient summed once both ranks reach
    their first optimizer step: from 9 to 9.25 (0.25 ms); then stage 0 steps (0.5 ms) and stage 1 (1.5 ms),
    the step ending at 10.75, where without the sum stage 1 stepped from 7 to 8.5 and stage 0 ended it at 9.5."""
    stages = (StageCosts(1.0, 2.0, ACT, STATIC, optimizer_ms=0.5), StageCosts(1.0, 2.0, ACT, STATIC, optimizer_ms=1.5))
    schedule = generate("gpipe", 2, 2)
    programs = schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, _chain(2)))
    apart = simulate(programs, schedule.layout, SimCosts(stages, _chain(2)))
    embedding = (TiedSum((0, 1), ("wte.weight",), 4096, 0.25),)
    tied = simulate(programs, schedule.layout, SimCosts(stages, _chain(2), tied_sums=embedding))
    assert apart.step_ms == pytest.approx(9.5)
    assert tied.step_ms == pytest.approx(10.75)
    summed = [(e.rank, e.action, e.lane, e.start_ms, e.end_ms) for e in tied.events if "ALLREDUCE" in e.action]
    assert summed == [(1, "1ALLREDUCE", "comm", 7.0, 9.25), (0, "0ALLREDUCE", "comm", 9.0, 9.25)]
    assert tied.busy_ms == apart.busy_ms  # waiting for the other copy is not compute


def test_a_tied_sum_one_rank_holds_alone_costs_nothing() -> None:
    """Stages 0 and 3 on rank 0, 1 and 2 on rank 1 (F 1, B 2, one micro-batch, optimizer 0.5 each): the step ends
    with rank 0's last backward at 12 and its two steps. A weight tied between stages 0 and 3 is one tensor on
    rank 0: no sum. Tied between stages 0 and 1, rank 0 waits 5 ms for its sum with rank 1."""
    layout = Layout.replicated((0, 1, 1, 0))
    rows = ("0F0 0SEND_F0>1 3RECV_F0<2 3F0 3B0 3SEND_B0>2 0RECV_B0<1 0B0 0OPTIMIZER_STEP 3OPTIMIZER_STEP",
            "1RECV_F0<0 1F0 2F0 2SEND_F0>3 2RECV_B0<3 2B0 1B0 1SEND_B0>0 1OPTIMIZER_STEP 2OPTIMIZER_STEP")
    programs = parse_programs(row.split() for row in rows)
    stages = tuple(StageCosts(1.0, 2.0, 10, 100, optimizer_ms=0.5) for _ in range(4))

    def step_ms(*tied: TiedSum) -> float:
        return simulate(programs, layout, SimCosts(stages, {}, tied_sums=tied)).step_ms
    assert step_ms() == pytest.approx(13.0)
    assert step_ms(TiedSum((0, 3), ("w",), 10, 5.0)) == pytest.approx(13.0)
    assert step_ms(TiedSum((0, 1), ("w",), 10, 5.0)) == pytest.approx(12.0 + 5.0 + 1.0)


def test_every_action_is_one_event_on_its_lane() -> None:
    schedule = generate("1f1b", 3, 4, data_parallel=2)
    programs = schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, _chain(3)))
    result = simulate(programs, schedule.layout, SimCosts(_equal(3), {}))
    assert sorted(e.action for e in result.events) == sorted(str(a) for p in programs for a in p)
    for event in result.events:
        compute = event.action[1] in "FB" or "OPTIMIZER" in event.action
        assert event.lane == ("compute" if compute else "comm")
        assert 0.0 <= event.start_ms <= event.end_ms <= result.step_ms


def test_stages_sharing_a_rank_add_their_memory() -> None:
    layout = Layout.replicated((0, 1, 1, 0))
    rows = ("0F0 0SEND_F0>1 3RECV_F0<2 3F0 3B0 3SEND_B0>2 0RECV_B0<1 0B0",
            "1RECV_F0<0 1F0 2F0 2SEND_F0>3 2RECV_B0<3 2B0 1B0 1SEND_B0>0")
    programs = parse_programs(row.split() for row in rows)
    stages = tuple(StageCosts(1.0, 2.0, 10 * (stage + 1), 100) for stage in range(4))
    result = simulate(programs, layout, SimCosts(stages, {}))
    assert result.peak_mem_bytes == (200 + 10 + 40, 200 + 20 + 30)
    assert result.step_ms == pytest.approx(12.0)


def test_a_deadlocked_program_cannot_be_simulated() -> None:
    programs = parse_programs([["0RECV_B0<1", "0F0", "0SEND_F0>1", "0B0"], ["1RECV_F0<0", "1F0", "1B0",
                                                                           "1SEND_B0>0"]])
    with pytest.raises(ScheduleError, match="ranks wait forever.*run validate"):
        simulate(programs, Layout.pipeline(2), SimCosts(_equal(2), {}))


def test_costs_must_cover_every_stage() -> None:
    schedule = generate("gpipe", 3, 2)
    with pytest.raises(ValueError, match="costs give 2 stages but the layout has 3"):
        simulate(schedule.programs, schedule.layout, SimCosts(_equal(2), {}))
