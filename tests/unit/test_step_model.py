"""The cost terms' step time and memory against the simulator replaying the same schedule, on random instances.

The simulator is what a plan predicts; the closed form is what the ILP optimises. For GPipe they
are equal (a flow shop of identical micro-batches, forward then backward, every all-reduce
overlapping the drain of the parts before it); every slot's memory peak is equal for every
schedule. 1F1B's closed form is an approximation, measured here.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.comm import hidden_share, overlapped_share
from cost_models.device_spec import BACKENDS
from planner.plan import ScheduleKind
from planner.schedules import SimCosts, SimResult, StageCosts, generate, lower, max_in_flight, simulate
from planner.search.evaluate import Evaluation, evaluate
from planner.search.problem import LinearCost, PipelineProblem, SharedParam, Unit
from planner.search.terms import CostModel, cost_model

SHARED = (SharedParam("tied.weight", 700, 100),)


@st.composite
def instances(draw, kind: ScheduleKind) -> tuple[CostModel, tuple[int, ...]]:
    """A random configuration of ``kind`` (replicas, heterogeneous links and all-reduces) and a random cut."""
    num_units = draw(st.integers(1, 9))
    num_stages = draw(st.integers(1, min(num_units, 5)))
    replicas = draw(st.integers(1, 3))
    microbatches = draw(st.integers(1, 7))
    ms = st.floats(0.0, 10.0, allow_nan=False)
    units = tuple(Unit((f"n{i}",), draw(ms), draw(ms), draw(st.integers(0, 1000)), draw(st.integers(0, 300)),
                       draw(st.integers(0, 1000)), draw(st.integers(0, 300)),
                       tuple(draw(st.sets(st.just(0), max_size=1))))
                  for i in range(num_units))
    schedule = generate(kind, num_stages, microbatches, data_parallel=replicas)
    links = tuple(LinearCost(draw(st.floats(0, 2)), draw(st.floats(0, 0.02))) for _ in range(num_stages - 1))
    allreduce = tuple(LinearCost(draw(st.floats(0, 5)), draw(st.floats(0, 0.05))) if replicas > 1
                      else LinearCost(0.0, 0.0) for _ in range(num_stages))
    problem = PipelineProblem(units, tuple(draw(st.integers(0, 1000)) for _ in range(num_units - 1)), SHARED,
                              schedule.layout, kind, microbatches, max_in_flight(schedule), links, allreduce,
                              10**15, backend=draw(st.sampled_from(BACKENDS)))
    cuts = tuple(sorted(draw(st.sets(st.integers(0, num_units - 2), min_size=num_stages - 1,
                                     max_size=num_stages - 1)))) if num_units > 1 else ()
    return cost_model(problem), cuts


def replay(costs: CostModel, evaluation: Evaluation) -> SimResult:
    """The schedule lowered with a transfer across every cut, replayed on the evaluated part costs."""
    problem = costs.problem
    schedule = generate(problem.schedule, problem.num_parts, problem.num_microbatches,
                        data_parallel=problem.layout.data_parallel)
    edges = {(part, part + 1): summary.send_ms for part, summary in enumerate(evaluation.parts[:-1])}
    programs = schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, edges))
    stages = tuple(StageCosts(p.fwd_ms, p.bwd_ms, p.activation_bytes, p.held_bytes, p.allreduce_ms,
                              step_bytes=p.step_excess_bytes, tied_bytes=p.tied_excess_bytes,
                              accumulate_bytes=p.accumulate_excess_bytes)
                   for p in evaluation.parts)
    return simulate(programs, schedule.layout, SimCosts(stages, edges))


@settings(max_examples=400, deadline=None)
@given(instances(ScheduleKind.GPIPE))
def test_gpipe_step_equals_the_simulator(instance: tuple[CostModel, tuple[int, ...]]) -> None:
    costs, cuts = instance
    evaluation = evaluate(costs, cuts)
    simulated = replay(costs, evaluation)
    assert evaluation.step_ms == pytest.approx(simulated.step_ms, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("kind", [k for k in ScheduleKind if k.closed_form])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_every_ranks_peak_memory_equals_the_simulator(kind: ScheduleKind, data: st.DataObject) -> None:
    costs, cuts = data.draw(instances(kind))
    evaluation = evaluate(costs, cuts)
    simulated = replay(costs, evaluation)
    layout = costs.problem.layout
    expected = tuple(evaluation.slot_peak_bytes[layout.place(rank).slot] for rank in range(layout.world_size))
    assert simulated.peak_mem_bytes == expected


def test_one_f_one_b_closed_form_is_an_approximation_within_measured_bounds() -> None:
    """1F1B's closed form is exact on uniform parts without transfers; with transfers and uneven
    parts it over-states the replayed step (its round trip assumes one micro-batch in flight where
    1F1B keeps several; the exact step needs the schedule's event times, not a sum of maxima).
    Measured on 2,000 such instances: never below the replay, median +4%, 95th percentile +19%,
    worst +39%. The plan's predicted step is the replay."""
    rng = random.Random(0)
    errors = []
    for _ in range(300):
        costs, cuts = _random(rng)
        evaluation = evaluate(costs, cuts)
        errors.append(evaluation.step_ms / replay(costs, evaluation).step_ms - 1)
    assert -1e-9 < min(errors) and max(errors) < 0.5, (min(errors), max(errors))
    for parts, microbatches in itertools.product(range(1, 6), range(1, 9)):
        uniform = _uniform(ScheduleKind.ONE_F_ONE_B, parts, microbatches)
        evaluation = evaluate(uniform, tuple(range(parts - 1)))
        assert evaluation.step_ms == pytest.approx(replay(uniform, evaluation).step_ms, rel=1e-12)
        assert evaluation.step_ms == pytest.approx((microbatches + parts - 1) * 5.0)


def _random(rng: random.Random) -> tuple[CostModel, tuple[int, ...]]:
    num_units = rng.randint(2, 8)
    num_stages = rng.randint(1, min(num_units, 4))
    units = tuple(Unit((f"n{i}",), rng.uniform(0.1, 5), rng.uniform(0.1, 5), 0, 0, 0, 0) for i in range(num_units))
    schedule = generate(ScheduleKind.ONE_F_ONE_B, num_stages, rng.randint(1, 8))
    problem = PipelineProblem(units, tuple(rng.randint(0, 500) for _ in range(num_units - 1)), (), schedule.layout,
                              ScheduleKind.ONE_F_ONE_B, schedule.num_microbatches, max_in_flight(schedule),
                              tuple(LinearCost(rng.uniform(0, 1), 0.001) for _ in range(num_stages - 1)),
                              tuple(LinearCost(0.0, 0.0) for _ in range(num_stages)), 10**15)
    return cost_model(problem), tuple(sorted(rng.sample(range(num_units - 1), num_stages - 1)))


def _uniform(kind: ScheduleKind, num_stages: int, microbatches: int) -> CostModel:
    """One unit per part, every part alike (2 ms forward, 3 ms backward), transfers free."""
    units = tuple(Unit((f"n{i}",), 2.0, 3.0, 0, 0, 0, 0) for i in range(num_stages))
    schedule = generate(kind, num_stages, microbatches)
    return cost_model(PipelineProblem(units, (100,) * (num_stages - 1), (), schedule.layout, kind, microbatches,
                                      max_in_flight(schedule), (LinearCost(0.0, 0.0),) * (num_stages - 1),
                                      (LinearCost(0.0, 0.0),) * num_stages, 10**15))


def test_gloo_ranks_hold_the_next_runs_receives_and_hide_no_all_reduce() -> None:
    """Three one-unit parts, 2 replicas, by hand: on gloo a middle part also holds the next run's input
    (100 B received) and the gradient of what it sent (200 B), the first only the latter and the last only
    the former; NCCL posts no receive early. gloo hides none of an all-reduce in the backward (the sums take
    the rank's own core), NCCL DDP's buckets before the last."""
    units = tuple(Unit((f"n{i}",), 2.0, 3.0, 0, 0, 0, 0) for i in range(3))
    schedule = generate(ScheduleKind.GPIPE, 3, 4, data_parallel=2)

    def parts(backend: str) -> tuple:
        problem = PipelineProblem(units, (100, 200), (), schedule.layout, ScheduleKind.GPIPE, 4,
                                  max_in_flight(schedule), (LinearCost(0.0, 0.0),) * 2,
                                  (LinearCost(1.0, 0.0),) * 3, 10**15, backend=backend)
        return evaluate(cost_model(problem), (0, 1)).parts

    nccl, gloo = parts("nccl"), parts("gloo")
    assert [g.static_bytes - n.static_bytes for g, n in zip(gloo, nccl, strict=True)] == [100, 100 + 200, 200]
    assert hidden_share(64 * 2**20, "gloo") == 0.0
    assert hidden_share(64 * 2**20, "nccl") == overlapped_share(64 * 2**20) > 0.5
