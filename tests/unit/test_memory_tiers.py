"""Memory decisions in the search: per-unit recompute and swap in the partition ILP, the state mode
per configuration, the host and NVMe they use, and how plans show them.

The ILP with whole-unit decisions equals a brute force over every cut and every unit's
keep/recompute/swap; with shares (the planner's default) it is never worse than that and its plan,
rounded to whole units, still fits; the simulator replays swaps as hand-computed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cost_models import estimate
from cost_models.device_spec import OptimizerStepCost
from cost_models.errors import InvalidArgument, PlanInfeasible
from cost_models.memory import Optimizer, Precision
from examples.models.gpt import gpt, gpt_tiny
from planner import plan, trace
from planner.plan import Layout, OffloadSpec, ParamTier, Plan, ScheduleKind, StateTier
from planner.schedules.balanced import BalancedStep
from planner.schedules.generate import gpipe
from planner.schedules.lower import lower
from planner.schedules.simulate import SimCosts, StageCosts, simulate
from planner.schedules.swaps import insert_swaps
from planner.search.evaluate import Decisions, Evaluation, PartSummary, evaluate, row_value
from planner.search.ilp import IlpResult, SolveStatus, solve_partition
from planner.search.oracle import _row_interp, decided_step_floor, shared_slot_step_floor, window_memory_floor
from planner.search.problem import (
    ON_GPU,
    LinearCost,
    MemoryTiers,
    Offload,
    PipelineProblem,
    SharedParam,
    StateMode,
    Unit,
    group_units,
    state_modes,
)
from planner.search.search import whole_units
from planner.search.terms import CostModel, cost_model, lower_bound, memory_floor

LINK = LinearCost(0.0, 0.002)  # host link: 2 ms per 1000 bytes


def _tiers(recompute: bool = True, swap: bool = True, state: StateMode = ON_GPU) -> MemoryTiers:
    return MemoryTiers(recompute, swap, state, LINK, LINK, 0.001, 0.0004, 0.0005, 4, 10**9, 10**9, 8,
                       host_master_bytes_per_param=4)


@st.composite
def decided_problems(draw, max_stages: int = 2, tied: bool = False) -> PipelineProblem:
    """Small problems with recompute and swap to decide; with ``tied``, sometimes a weight the first unit and the
    last share (a tied embedding and head: a rank running both ends keeps one copy), and maybe a middle unit."""
    num_units = draw(st.integers(2, 5))
    num_stages = draw(st.integers(1, min(num_units, max_stages)))
    microbatches = draw(st.integers(1, 4))
    ms = st.floats(0.1, 10.0, allow_nan=False)
    units = []
    for i in range(num_units):
        saved = draw(st.integers(0, 1000))
        units.append(Unit((f"n{i}",), draw(ms), draw(ms), draw(st.integers(0, 500)), 0, saved,
                          draw(st.integers(0, 200)), (), 0, 0, 0, saved, draw(st.integers(0, saved))))
    shared: tuple[SharedParam, ...] = ()
    if tied and draw(st.booleans()):
        grad = draw(st.integers(0, 100))
        shared = (SharedParam("w", state_bytes=grad + draw(st.integers(0, 300)), grad_bytes=grad),)
        users = {0, num_units - 1} | set(draw(st.lists(st.integers(0, num_units - 1), max_size=1)))
        units = [dataclasses.replace(unit, shared=(0,)) if i in users else unit for i, unit in enumerate(units)]
    schedule = draw(st.sampled_from([k for k in ScheduleKind if k.closed_form]))
    in_flight = tuple(microbatches if schedule is ScheduleKind.GPIPE else min(microbatches, num_stages - s)
                      for s in range(num_stages))
    return PipelineProblem(tuple(units), tuple(draw(st.integers(0, 300)) for _ in range(num_units - 1)), shared,
                           Layout.pipeline(num_stages), schedule, microbatches, in_flight,
                           tuple(LinearCost(0.1, 0.001) for _ in range(num_stages - 1)),
                           tuple(LinearCost(0.0, 0.0) for _ in range(num_stages)),
                           draw(st.integers(300, 6000)), _tiers())


def _every_plan(costs: CostModel) -> Iterator[Evaluation]:
    """Every cut and every unit kept (0), recomputed (1) or swapped (2), fitting or not."""
    count = costs.num_units
    for cuts in itertools.combinations(range(count - 1), costs.num_parts - 1):
        for choice in itertools.product((0, 1, 2), repeat=count):
            decisions = Decisions(tuple(float(c == 1) for c in choice), tuple(float(c == 2) for c in choice))
            yield evaluate(costs, cuts, decisions)


def _brute_force(costs: CostModel) -> float | None:
    """The fastest of every plan that fits."""
    best = None
    for evaluation in _every_plan(costs):
        if evaluation.fits(costs.problem.mem_bytes) and (best is None or evaluation.step_ms < best - 1e-9):
            best = evaluation.step_ms
    return best


def ilp_equals_brute_force(costs: CostModel) -> IlpResult | None:
    """The whole-unit ILP's plan, after checking its step equals the brute force's (None: nothing fits,
    and the ILP says so)."""
    expected = _brute_force(costs)
    result = solve_partition(costs, integral=True)
    if expected is None:
        assert result.cuts is None
        return None
    assert result.objective == pytest.approx(expected, rel=1e-6, abs=1e-6)
    return result


@settings(max_examples=40, deadline=None)
@given(decided_problems())
def test_ilp_with_whole_unit_decisions_equals_brute_force(problem: PipelineProblem) -> None:
    costs = cost_model(problem)
    result = ilp_equals_brute_force(costs)
    if result is None:
        return
    evaluation = evaluate(costs, result.cuts, result.decisions)
    assert evaluation.step_ms == pytest.approx(result.objective, rel=1e-6, abs=1e-6)
    assert evaluation.fits(problem.mem_bytes)


ROUNDED_OVER = PipelineProblem(  # CI's falsifying example: 0.25 of unit 0 recomputed and 0.75 swapped fit
    (Unit(("n0",), 0.25, 1.0, 0, 0, 502, 0, (), 0, 0, 0, 502, 252),
     Unit(("n1",), 1.0, 1.0, 0, 0, 1, 0, (), 0, 0, 0, 1, 0), Unit(("n2",), 1.0, 1.0, 0, 0, 0, 0, (), 0, 0, 0, 0, 0)),
    (0, 0), (), Layout.pipeline(1), ScheduleKind.GPIPE, 4, (4,), (), (LinearCost(0.0, 0.0),), 1510, _tiers())


@settings(max_examples=40, deadline=None)
@given(decided_problems())
@example(ROUNDED_OVER)
def test_shares_bound_the_optimum_and_their_rounding_or_else_whole_units_fit(problem: PipelineProblem) -> None:
    costs = cost_model(problem)
    expected = _brute_force(costs)
    result = solve_partition(costs)
    if expected is None:
        return  # shares may fit where whole units do not; the search then solves again with whole units
    assert result.objective <= expected + 1e-6
    rounded = evaluate(costs, result.cuts, whole_units(result.decisions))
    if rounded.fits(problem.mem_bytes):
        assert rounded.step_ms >= expected - 1e-6
    else:
        # rounding may need more memory: a unit with a recompute share is recomputed whole, keeping its input
        # where a swap share of it had moved that to the host (ROUNDED_OVER: 1513 bytes against 1510); with
        # fewer than 2 micro-batches in flight a swapped share rounds to 2 resident. The search then solves
        # with whole units (Search._decide), which is exact
        whole = solve_partition(costs, integral=True)
        assert whole.objective == pytest.approx(expected, abs=1e-6)
        assert evaluate(costs, whole.cuts, whole_units(whole.decisions)).fits(problem.mem_bytes)


@settings(max_examples=60, deadline=None)
@given(decided_problems(), st.sampled_from([ON_GPU, StateMode(0, StateTier.HOST), StateMode(0, StateTier.NVME)]))
def test_the_search_lower_bound_is_below_every_partition_and_decision(problem: PipelineProblem,
                                                                      state: StateMode) -> None:
    """The bound that prunes configurations (host optimizer tails included) is at most the step of
    every partition with every keep/recompute/swap choice, fitting or not (brute force)."""
    costs = cost_model(dataclasses.replace(problem, tiers=dataclasses.replace(problem.tiers, state=state)))
    bound = lower_bound(costs)
    for evaluation in _every_plan(costs):
        assert bound <= evaluation.step_ms + 1e-9


@settings(max_examples=60, deadline=None)
@given(decided_problems(max_stages=3), st.sampled_from([ON_GPU, StateMode(0, StateTier.HOST), StateMode(0, StateTier.NVME)]))
def test_the_bound_with_memory_decisions_is_below_every_fitting_plan(problem: PipelineProblem,
                                                                     state: StateMode) -> None:
    """The bound that prunes configurations needing recompute or swap (the time freeing memory costs) is at
    most the step of every fitting partition with every keep/recompute/swap choice (brute force) and the
    ILP's optimum with shares; inf only where the ILP finds nothing that fits."""
    costs = cost_model(dataclasses.replace(problem, tiers=dataclasses.replace(problem.tiers, state=state)))
    bound = decided_step_floor(costs)
    fitting = [evaluation.step_ms for evaluation in _every_plan(costs) if evaluation.fits(problem.mem_bytes)]
    assert all(bound <= step + 1e-9 for step in fitting)
    result = solve_partition(costs)
    if bound == float("inf"):
        assert result.status is SolveStatus.INFEASIBLE and not fitting
    if result.objective is not None:
        assert bound <= result.objective + 1e-6
    if 0 < bound < float("inf"):  # told what is enough, it stops at a bound that reaches it, never above the full one
        enough = bound / 2
        assert enough <= decided_step_floor(costs, enough) <= bound + 1e-9


def _laid_out(problem: PipelineProblem, layout: str, decides: bool) -> PipelineProblem:
    """``problem`` on one part a slot ("pipeline"), two parts a slot ("interleaved") or GEMS's two mirrored copies,
    each stage holding every micro-batch, with its memory decisions or none."""
    parts = problem.num_parts
    if layout != "pipeline":
        slots = max(1, parts // 2) if layout == "interleaved" else parts
        shaped = (Layout.replicated(tuple(part % slots for part in range(parts))) if layout == "interleaved"
                  else Layout.mirrored(parts))
        problem = dataclasses.replace(problem, layout=shaped, in_flight=(problem.num_microbatches,) * shaped.num_stages)
    if not decides:
        problem = dataclasses.replace(problem, tiers=_tiers(recompute=False, swap=False))
    return problem


@settings(max_examples=80, deadline=None)
@given(decided_problems(max_stages=3, tied=True), st.sampled_from(["pipeline", "interleaved", "mirrored"]), st.booleans())
def test_the_memory_floor_is_below_every_plans_peak(problem: PipelineProblem, layout: str, decides: bool) -> None:
    """What lets the search skip a configuration's ILPs: no partition, with any recompute and swap where the
    problem decides them, needs less than the memory floor, for ranks holding one part or several (two parts a
    slot interleaved, or GEMS's two mirrored copies)."""
    parts = problem.num_parts
    costs = cost_model(_laid_out(problem, layout, decides))
    floor = memory_floor(costs)
    plans = (_every_plan(costs) if decides else
             (evaluate(costs, cuts) for cuts in itertools.combinations(range(costs.num_units - 1), parts - 1)))
    assert all(floor <= evaluation.peak_mem_bytes + 1e-6 for evaluation in plans)


@settings(max_examples=80, deadline=None)
@given(decided_problems(max_stages=3, tied=True), st.sampled_from(["pipeline", "interleaved", "mirrored"]), st.booleans(),
       st.data())
def test_the_memory_floor_within_a_window_is_below_every_plans_peak_in_it(
        problem: PipelineProblem, layout: str, decides: bool, data: st.DataObject) -> None:
    """What lets the search skip the ILP of a window whose slots hold several parts: no partition with its cuts in
    the window, with any recompute and swap where the problem decides them, needs less than the window's memory
    floor (brute force), for ranks holding one part or several."""
    parts = problem.num_parts
    costs = cost_model(_laid_out(problem, layout, decides))
    count = costs.num_units
    around = data.draw(st.sampled_from(list(itertools.combinations(range(count - 1), parts - 1))))
    width = data.draw(st.integers(0, 2))
    window = tuple((max(-1, cut - width), min(count - 2, cut + width)) for cut in around)
    floor = window_memory_floor(costs, window)
    plans = (_every_plan(costs) if decides else
             (evaluate(costs, cuts) for cuts in itertools.combinations(range(count - 1), parts - 1)))
    inside = [e for e in plans if all(low <= cut <= high for cut, (low, high) in zip(e.cuts, window))]
    assert inside  # the window holds the partition it was drawn around
    assert all(floor <= evaluation.peak_mem_bytes + 1e-6 for evaluation in inside)
    if not decides and width == 0:  # one partition, nothing decided: the floor is its peak
        assert floor == pytest.approx(inside[0].peak_mem_bytes, rel=1e-9, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(decided_problems(max_stages=3), st.data())
def test_the_bound_within_a_window_is_below_every_fitting_plan_in_it(problem: PipelineProblem,
                                                                     data: st.DataObject) -> None:
    """Restricted to a window of cuts (as the search's ILP with memory decisions is), the bound is at
    most the step of every fitting plan whose cuts lie in it (brute force), and at least the bound
    over every partition; the window's ILP finds nothing below it."""
    costs = cost_model(problem)
    count = costs.num_units
    around = data.draw(st.sampled_from(list(itertools.combinations(range(count - 1), costs.num_parts - 1))))
    width = data.draw(st.integers(0, 2))  # each cut within width units of a partition's, as the search's
    window = tuple((max(-1, cut - width), min(count - 2, cut + width)) for cut in around)
    bound = decided_step_floor(costs, window=window)
    inside = [evaluation for evaluation in _every_plan(costs)
              if all(low <= cut <= high for cut, (low, high) in zip(evaluation.cuts, window))]
    assert all(bound <= e.step_ms + 1e-9 for e in inside if e.fits(problem.mem_bytes))
    assert bound >= decided_step_floor(costs) - 1e-9
    result = solve_partition(costs, window=window)
    if result.objective is not None:
        assert bound <= result.objective + 1e-6


def _replayed(problem: PipelineProblem, rank_work: int, path_parts: float) -> PipelineProblem:
    """``problem`` costed as a family without a closed form (interleaved 1F1B's step model: its programs on
    balanced parts took ``rank_work - 1 + path_parts`` part-times)."""
    return dataclasses.replace(problem, schedule=ScheduleKind.INTERLEAVED_1F1B,
                               balanced=BalancedStep(float(rank_work - 1) + path_parts, 1.0, rank_work))


@settings(max_examples=80, deadline=None)
@given(decided_problems(max_stages=3, tied=True), st.sampled_from(["pipeline", "interleaved", "mirrored"]), st.booleans(),
       st.data())
def test_the_shared_slot_bound_within_a_window_is_below_every_fitting_plan_in_it(
        problem: PipelineProblem, layout: str, replayed: bool, data: st.DataObject) -> None:
    """What lets the search skip the ILP with memory decisions of a window whose slots hold several parts: no
    partition with its cuts in the window, with any recompute and swap, that fits beats the shared slots' step
    floor (brute force over whole-unit decisions, and the window's ILP with shares), for the closed forms'
    objectives and the replayed families' alike."""
    problem = _laid_out(problem, layout, decides=True)
    if replayed:
        problem = _replayed(problem, data.draw(st.integers(1, 8)), data.draw(st.floats(0.0, 4.0)))
    costs = cost_model(problem)
    count = costs.num_units
    around = data.draw(st.sampled_from(list(itertools.combinations(range(count - 1), costs.num_parts - 1))))
    width = data.draw(st.integers(0, 2))
    window = tuple((max(-1, cut - width), min(count - 2, cut + width)) for cut in around)
    bound = shared_slot_step_floor(costs, window)
    inside = [e for e in _every_plan(costs) if all(low <= cut <= high for cut, (low, high) in zip(e.cuts, window))]
    assert all(bound <= e.step_ms + 1e-9 for e in inside if e.fits(problem.mem_bytes))
    result = solve_partition(costs, window=window)
    if result.objective is not None:
        assert bound <= result.objective + 1e-6
    enough = bound / 2
    if 0 < bound < float("inf"):  # told what is enough, it may stop at a bound reaching it, never above the full one
        assert enough <= shared_slot_step_floor(costs, window, enough) <= bound + 1e-9


def test_the_shared_slot_bound_counts_the_recompute_a_slot_needs() -> None:
    """Eight alike units on two parts sharing one slot (interleaved), cut after unit 3: each unit saves 1000 bytes,
    250 of them its last node's (what recomputing it frees). While a recomputed region's backward runs, each part
    holds its block of 4 units' 1000 bytes again, so the slot holds 10,000 bytes, 1000 over the budget: 4 units
    recomputed, 2 ms each (their forward again). The step model sums the parts' compute (replayed with rank_work
    1, path_parts 2): 8 x (2 + 3) ms plus 8 ms of recompute; the objective alone (the lower bound) sees 40."""
    unit = Unit(("n",), 2.0, 3.0, 0, 0, 1000, 0, offloadable_bytes=250)
    units = tuple(dataclasses.replace(unit, nodes=(f"n{i}",)) for i in range(8))
    problem = PipelineProblem(units, (0,) * 7, (), Layout.replicated((0, 0)), ScheduleKind.GPIPE, 1, (1, 1),
                              (LinearCost(0.0, 0.0),), (LinearCost(0.0, 0.0),) * 2, 9000, _tiers(swap=False))
    costs = cost_model(_replayed(problem, 1, 2.0))
    window = ((3, 3),)
    assert lower_bound(costs) == pytest.approx(40.0)
    assert shared_slot_step_floor(costs, window) == pytest.approx(48.0)
    assert solve_partition(costs, window=window).objective == pytest.approx(48.0)


def test_recompute_adds_the_forward_and_keeps_only_the_inputs() -> None:
    unit = Unit(("a",), 2.0, 3.0, 100, 0, 1000, 10, (), 0, 0, 0, 1000, 200)
    problem = PipelineProblem((unit, unit), (50,), (), Layout.pipeline(1), ScheduleKind.GPIPE, 3, (3,), (),
                              (LinearCost(0.0, 0.0),), 10**6, _tiers())
    costs = cost_model(problem)
    kept, recomputed = (evaluate(costs, (), Decisions((r, 0.0), (0.0, 0.0))) for r in (0.0, 1.0))
    assert recomputed.parts[0].bwd_ms - kept.parts[0].bwd_ms == 2.0
    assert kept.parts[0].activation_bytes - recomputed.parts[0].activation_bytes == 800
    # 3 micro-batches in flight x 800 bytes fewer, and the recomputed unit's 1000 bytes while its backward runs
    assert kept.slot_peak_bytes[0] - recomputed.slot_peak_bytes[0] == 3 * 800


@pytest.mark.parametrize(("loss_node_transient", "peaks"), [
    (10, (200 + 5000 + 3 * 2000, 200 + 5000 + 3 * 1200)),  # the loss's 5000 bytes, without the block's 2000
    (None, (200 + 5000 + 3 * 2000 + 2000, 200 + 5000 + 3 * 1200 + 2000)),  # a node's 5000: beside the block's
])
def test_a_recomputed_regions_backward_is_not_counted_beside_the_losss_working_bytes(
        loss_node_transient: int | None, peaks: tuple[int, int]) -> None:
    """Two units of one block (2000 saved bytes together, 200 of state), 3 micro-batches in flight, the
    second holding the loss, whose backward works on 5000 bytes. The loss's backward runs before any
    recomputed region's, so the peak is the larger of the two moments: model state + 5000 + activations,
    or model state + a node's working set (10) + activations + the block rematerialised (2000). Were the
    5000 bytes a node's own (``None``), they and the block would be held at once. Recomputing the first
    unit keeps 200 of its 1000 bytes per micro-batch."""
    unit = Unit(("a",), 2.0, 3.0, 100, 0, 1000, 10, (), 0, 0, 0, 1000, 200)
    loss = Unit(("loss",), 1.0, 1.0, 100, 0, 1000, 5000, (), 0, 0, 0, 1000, 200,
                node_transient_bytes=loss_node_transient)
    problem = PipelineProblem((unit, loss), (50,), (), Layout.pipeline(1), ScheduleKind.GPIPE, 3, (3,), (),
                              (LinearCost(0.0, 0.0),), 10**6, _tiers())
    costs = cost_model(problem)
    assert tuple(evaluate(costs, (), Decisions((r, 0.0), (0.0, 0.0))).slot_peak_bytes[0]
                 for r in (0.0, 1.0)) == peaks


@pytest.mark.parametrize(("tied_grad_bytes", "excess"), [(150, 0), (3000, 6000 - (5000 - 4))])
def test_the_simulators_tied_event_is_the_memory_rows_backward_end(tied_grad_bytes: int, excess: int) -> None:
    """A unit whose 2 uses of a tied weight hold 2 x its gradient at the end of its backward, after the loss's
    (5000 working bytes; a node's 10, the node summing the two 4): the "backward" row holds the sums beside the
    summing node's 4 bytes in place of the 5000 and one micro-batch fewer; the simulator holds its static bytes
    all step and adds only what the sums exceed of the 4996 bytes it holds beyond them
    (PartSummary.tied_excess_bytes)."""
    tied = Unit(("a",), 2.0, 3.0, 100, 0, 1000, 10, (), 0, 0, 0, 1000, 200, tied_grad_bytes=tied_grad_bytes,
                summing_transient_bytes=4)
    loss = Unit(("loss",), 1.0, 1.0, 100, 0, 1000, 5000, (), 0, 0, 0, 1000, 200, node_transient_bytes=10)
    problem = PipelineProblem((tied, loss), (50,), (), Layout.pipeline(1), ScheduleKind.GPIPE, 3, (3,), (),
                              (LinearCost(0.0, 0.0),), 10**6, _tiers(recompute=False, swap=False))
    costs = cost_model(problem)
    part = evaluate(costs, ()).parts[0]
    assert part.tied_excess_bytes == excess
    (row,) = [row for row in costs.memory if row.moment == "backward"]
    assert row_value(costs, row, [(0, 1)]) == 200 + 4 + 2 * tied_grad_bytes + 2 * 2000
    if excess > 0:  # the simulator's level at that moment: held all step, 2 micro-batches, the excess
        assert part.held_bytes + 2 * 2000 + part.tied_excess_bytes == row_value(costs, row, [(0, 1)])


def test_tied_gradients_are_summed_beside_their_first_users_working_set_not_the_heads() -> None:
    """GPT's token embedding is its output head too: autograd sums the head's partial gradient with the
    embedding's in the embedding's backward, whose working set (its output and that output's gradient: 2 x
    1 x 16 x 128 floats) is all that is computing then, not the head's (2 x 1 x 16 x 256). By hand, per
    unit: one node a unit, the embedding 2 x 8 KiB and the head nothing (the weight's last user); the whole
    model as one unit, the embedding's still."""
    model = gpt(vocab=256, hidden=128, layers=1, heads=4, seq_len=16, dropout=0.0, device="meta")
    graph = trace(model, torch.zeros(1, 16, dtype=torch.long, device="meta"))
    table = estimate(graph, "V100-16GB", "sgd", "fp32")
    embedding_bytes, head_bytes = 2 * 16 * 128 * 4, 2 * 16 * 256 * 4
    names = [node.name for node in graph]
    each = group_units(graph, table, Precision.FP32, Optimizer.SGD, list(range(1, len(names))))
    summing = {unit.nodes[0]: unit.summing_transient_bytes for unit in each.units if unit.summing_transient_bytes}
    assert summing == {"wte": embedding_bytes}
    assert max(unit.region_transient_bytes for unit in each.units) >= head_bytes
    (whole,) = group_units(graph, table, Precision.FP32, Optimizer.SGD, []).units
    assert whole.tied_grad_bytes == 256 * 128 * 4 and whole.summing_transient_bytes == embedding_bytes


def test_state_modes_follow_what_offload_allows() -> None:
    assert state_modes(frozenset(), sharded=True) == (ON_GPU,)
    everything = state_modes(frozenset(Offload), sharded=True)
    assert len(everything) == 11 and StateMode(1, StateTier.NVME) in everything
    assert StateMode(3, StateTier.HOST) in everything
    assert StateMode(3, StateTier.NVME, params_on_host=True) in everything
    assert not any(mode.params_on_host for mode in state_modes(frozenset(Offload) - {Offload.PARAMS}, sharded=True))
    assert state_modes(frozenset({Offload.HOST}), sharded=True) == (ON_GPU, StateMode(0, StateTier.HOST))
    assert all(mode.zero_stage == 0 for mode in state_modes(frozenset(Offload), sharded=False))
    with pytest.raises(InvalidArgument, match="offload must be True, False or some of"):
        Offload.parse(["tape"])
    with pytest.raises(InvalidArgument, match=r"^offload \['grads', 'zero'\] sends gradients .* add 'host' or 'nvme'$"):
        Offload.parse(["zero", "grads"])
    with pytest.raises(InvalidArgument, match=r"^offload \['host', 'params'\] keeps ZeRO-3's weight shards .* 'zero'"):
        Offload.parse(["params", "host"])
    assert Offload.parse(["zero", "nvme", "params"]) == {Offload.ZERO, Offload.NVME, Offload.PARAMS}


def test_host_optimizer_state_per_parameter_by_hand() -> None:
    """Adam in fp32: 16 bytes per parameter on the GPU; with the optimizer on the host, 8 on the GPU
    (weights and gradients) and 16 on the host (the step's fp32 master copy, two moments, fp32
    gradients); on NVMe the master and moments (12) there, the gradients (4) on the host."""
    unit = Unit(("a",), 1.0, 1.0, 16_000, 4000, 0, 0, (), 4000, 8000, 1000, 0, 0)
    for state, device, host in ((ON_GPU, 16_000, 0), (StateMode(0, StateTier.HOST), 8000, 16_000),
                                (StateMode(0, StateTier.NVME), 8000, 4000)):
        problem = PipelineProblem((unit,), (), (), Layout.pipeline(1), ScheduleKind.GPIPE, 1, (1,), (),
                                  (LinearCost(0.0, 0.0),), 10**6, _tiers(False, False, state))
        part = evaluate(cost_model(problem), ()).parts[0]
        assert (part.static_bytes, part.host_bytes) == (device, host)
        assert part.nvme_bytes == (12_000 if state.optimizer is StateTier.NVME else 0)
    host = PipelineProblem((unit,), (), (), Layout.pipeline(1), ScheduleKind.GPIPE, 1, (1,), (),
                           (LinearCost(0.0, 0.0),), 10**6, _tiers(False, False, StateMode(0, StateTier.HOST)))
    # gradients down and weights up over the link (4000 + 4000 bytes at 0.002 ms/B), 1000 params at 0.001 ms
    assert evaluate(cost_model(host), ()).parts[0].optimizer_ms == pytest.approx(16.0 + 1.0)
    # bf16 (2-byte weights and gradients, fp32 masters): both still cross in fp32, cast on the GPU
    bf16 = Unit(("a",), 1.0, 1.0, 16_000, 2000, 0, 0, (), 2000, 12_000, 1000, 0, 0)
    assert evaluate(cost_model(dataclasses.replace(host, units=(bf16,))), ()).parts[0].optimizer_ms == \
        pytest.approx(16.0 + 1.0)
    # where the host's own step was measured (the cpu device: the host is the device), per tensor too: 3
    # tensors at 20 us and 1000 parameters at 10 ns, not 1000 at the host's default rate
    measured = dataclasses.replace(host, units=(dataclasses.replace(unit, param_tensors=3),),
                                   tiers=dataclasses.replace(host.tiers, host_step=OptimizerStepCost(20.0, 10.0)))
    assert evaluate(cost_model(measured), ()).parts[0].optimizer_ms == pytest.approx(16.0 + 0.06 + 0.01)


def test_gradients_sent_to_the_host_per_parameter_by_hand() -> None:
    """The fp32 Adam unit above with its gradients sent to the host each backward: on the GPU its weights (4000)
    and the cast of its largest parameter's gradient (500 x 4); on the host as before (16,000); each backward
    sends 1000 fp32 gradients down (4000 bytes at 0.002 ms/B) and adds them on the host (0.0004 ms a parameter); the
    step then only sends the weights up (8 ms) and steps (1 ms)."""
    unit = Unit(("a",), 1.0, 1.0, 16_000, 4000, 0, 0, (), 4000, 8000, 1000, 0, 0, largest_own_param_numel=500)
    sent = PipelineProblem((unit,), (), (), Layout.pipeline(1), ScheduleKind.GPIPE, 1, (1,), (), (LinearCost(0.0, 0.0),),
                           10**6, _tiers(False, False, StateMode(0, StateTier.HOST, grads_on_host=True)))
    part = evaluate(cost_model(sent), ()).parts[0]
    assert (part.static_bytes, part.host_bytes, part.grad_bytes) == (4000 + 2000, 16_000, 0)
    assert part.bwd_ms == pytest.approx(1.0 + 8.0 + 1000 * 0.0004)
    assert part.optimizer_ms == pytest.approx(8.0 + 1.0)
    assert StateMode(0, StateTier.NVME, grads_on_host=True) in state_modes(frozenset(Offload), sharded=False)
    assert not any(mode.grads_on_host for mode in state_modes(frozenset(Offload), sharded=True))


def test_zero_3_per_layer_by_hand() -> None:
    """ZeRO-3 over 2 replicas of the fp32 Adam unit above (1000 parameters: 4000 bytes of weights, 4000 of
    gradients, 8000 of moments), whose two module calls own 3000 and 800 bytes of its weights, and whose other 200
    (a weight read through get_attr) stay whole with their gradient (runtime/layer_gathers.py): on the device half
    the layered weights and gradients, the whole 200 twice, half the moments, and 4 copies of the largest layer
    (3000 bytes: its all-gather's rows and this rank's half-row, then the layer gathered from them; at its
    backward's end the gathered layer and its gradient; and the next gather started ahead, its rows and
    half-row). Each forward all-gathers the layers' weights
    (two calls at half the link's 1 ms and 3800 bytes at half its 0.001 ms/B: 2.9 ms), each backward that and the
    gradients' reduce-scatter (2 x 2.9 ms); the step's all-reduce sums the 200 whole bytes only, and no all-gather
    follows the step (ZeRO-1's does)."""
    unit = Unit(("a",), 1.0, 1.0, 16_000, 4000, 0, 0, (), 4000, 8000, 1000, 0, 0, layered_weight_bytes=3800,
                layered_grad_bytes=3800, layered_calls=2, largest_layer_bytes=3000)
    link = LinearCost(1.0, 0.001)

    def part(zero_stage: int) -> PartSummary:
        problem = PipelineProblem((unit,), (), (), Layout.pipeline(1, 2), ScheduleKind.GPIPE, 1, (1,), (),
                                  (link,), 10**6, _tiers(False, False, StateMode(zero_stage, StateTier.GPU)))
        return evaluate(cost_model(problem), ()).parts[0]

    zero_1, zero_3 = part(1), part(3)
    assert zero_3.static_bytes == (3800 + 3800) / 2 + 2 * 200 + 8000 / 2 + 4 * 3000
    assert zero_1.static_bytes == 4000 + 4000 + 8000 / 2
    assert zero_3.fwd_ms == pytest.approx(1.0 + 2 * 0.5 + 3800 * 0.0005)
    assert zero_3.bwd_ms == pytest.approx(1.0 + 2 * (2 * 0.5 + 3800 * 0.0005))
    assert (zero_1.fwd_ms, zero_1.bwd_ms) == (1.0, 1.0)
    assert zero_3.allreduce_ms == pytest.approx(1.0 + 200 * 0.001)
    assert zero_1.allreduce_ms == pytest.approx(1.0 + 4000 * 0.001)
    assert zero_1.optimizer_ms - zero_3.optimizer_ms == pytest.approx(0.5 + 4000 * 0.0005)  # ZeRO-1's gather
    assert not any(mode.zero_stage == 3 for mode in state_modes(frozenset(Offload), sharded=False))
    # the weights' shards on the host too (the optimizer there: its master copy and moments, half each, and half the
    # fp32 gradients): 1900 bytes of weights leave the device for the host, and each gather first copies them up
    # over the host link (0.002 ms/B)
    hosted = PipelineProblem((unit,), (), (), Layout.pipeline(1, 2), ScheduleKind.GPIPE, 1, (1,), (), (link,), 10**6,
                             _tiers(False, False, StateMode(3, StateTier.HOST, params_on_host=True)))
    part = evaluate(cost_model(hosted), ()).parts[0]
    assert part.static_bytes == 200 + 1900 + 200 + 4 * 3000
    assert part.host_bytes == 1000 * 4 / 2 + 1900 + (8000 + 1000 * 4) / 2
    assert part.fwd_ms == pytest.approx(1.0 + 2 * 0.5 + 3800 * 0.0005 + 1900 * 0.002)


def test_the_search_shards_weights_and_gradients_where_zero_1_and_pipelines_cost_more() -> None:
    """Megatron's 8.3B GPT in fp16 on 8 V100-32GB, batch 8, at a 20 GB budget: ZeRO-1 does not fit one stage, and
    the pipelines that fit run slower than one stage x 8 replicas with ZeRO-3 (its weights and gradients sharded,
    each layer gathered around its forward and backward); without ZeRO-3 in the search (offload without 'zero')
    the plan is slower."""
    from examples.models.gpt import megatron_8_3b

    arguments = {"gpus": 8, "batch_size": 8, "device": "V100-32GB", "precision": "fp16", "mem": "20GB",
                 "example_inputs": torch.empty(1, 1024, dtype=torch.long, device="meta")}
    model = megatron_8_3b()
    sharded = plan(model, **arguments)
    assert (sharded.num_stages, sharded.data_parallel, sharded.stages[0].offload.zero_stage) == (1, 8, 3)
    assert "model state sharded (ZeRO-3)" in str(sharded) and "ZeRO-3" in sharded.solver.why
    assert max(sharded.predicted.peak_mem_bytes) <= sharded.cluster.usable_mem_bytes
    without = plan(model, offload=["recompute", "swap", "host", "nvme"], **arguments)
    assert without.predicted.step_ms > sharded.predicted.step_ms


def test_zero_3_is_searched_with_every_family_whose_replicas_gather_together() -> None:
    """ZeRO-3's layer gathers are collectives over a part's copies, which must reach them in one order: replicas
    running the same program do (GPipe, 1F1B, interleaved 1F1B), GEMS-MASTER's mirror copies do not (they run a
    part at opposite ends of the schedule), and ZB-H1's W gathers no layer; the search offers ZeRO-3 only to
    the first."""
    from planner.api import validate_space
    from planner.search.configs import configurations

    space, _ = validate_space(8, "16GB", 16, "V100-16GB", None, "adam", "fp16", None, None, 60.0)
    configs = configurations(space, 64)
    sharded = {config.schedule for config in configs if config.state.zero_stage == 3}
    assert sharded == {ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED_1F1B}
    assert any(config.schedule is ScheduleKind.GEMS_MASTER and config.state.zero_stage == 1 for config in configs)


def test_zero_infinitys_layout_plans_with_the_weights_on_the_host() -> None:
    """The 50B GPT in fp32 on 16 V100-32GB held to one stage (ZeRO-Infinity's layout: no model parallelism): only
    ZeRO-3 with the optimizer and the weights' shards on the host fits, which the plan says and the plan file
    records (ParamTier.HOST)."""
    from examples.models.gpt import gpt_50b

    held = plan(gpt_50b(), gpus=16, batch_size=64, device="V100-32GB", mem="32GB", num_stages=[1],
                example_inputs=torch.empty(1, 1024, dtype=torch.long, device="meta"))
    offload = held.stages[0].offload
    assert (offload.zero_stage, offload.params) == (3, ParamTier.HOST) and offload.host_step
    assert "params on host" in str(held)
    assert Plan.from_dict(json.loads(held.to_json())).stages[0].offload == offload


def test_a_model_whose_weights_and_gradients_fill_the_gpu_trains_with_its_gradients_sent_to_the_host() -> None:
    """Megatron's 8.3B GPT in fp16 on one V100-32GB (ZeRO-Offload's scenario): 15.5 GiB of weights and as much of
    gradients do not fit beside a micro-batch's activations, whatever the optimizer's tier; sending the gradients
    to the host each backward does."""
    from examples.models.gpt import megatron_8_3b

    arguments = {"gpus": 1, "batch_size": 8, "device": "V100-32GB", "precision": "fp16",
                 "example_inputs": torch.empty(1, 1024, dtype=torch.long, device="meta")}
    model = megatron_8_3b()
    with pytest.raises(PlanInfeasible):
        plan(model, mem="32GB", offload=["recompute", "swap", "zero", "host", "nvme"], **arguments)
    sent = plan(model, mem="32GB", **arguments)
    assert sent.stages[0].offload.grads_on_host and sent.stages[0].offload.host_step
    assert "gradients to host each backward" in str(sent) and "bought the fit" in sent.solver.why
    assert max(sent.predicted.peak_mem_bytes) <= sent.cluster.usable_mem_bytes


def test_on_the_cpu_device_the_host_steps_as_the_device_does() -> None:
    """The cpu device's host is itself: an optimizer on the host steps at the device's measured per-tensor and
    per-parameter costs (plans on CPU ranks put the optimizer on the host where its flat rate, 1.01-1.15x,
    made it look faster than the same step on the device); a GPU preset's host keeps its rate."""
    from cost_models.devices import get_device
    from planner.api import validate_space
    from planner.search.problem import memory_tiers

    for name in ("cpu", "V100-16GB"):
        space, spec = validate_space(2, "1GB", 8, name, None, "adam", "fp32", None, None, 60.0)
        device = get_device(spec)
        tiers = memory_tiers(device, space, StateMode(0, StateTier.HOST), activations=False)
        assert tiers.host_step == (device.optimizer_step("adam") if name == "cpu" else None)
        assert tiers.host_step is None or tiers.host_step == tiers.device_step


def test_gradients_sent_to_the_host_are_summed_at_the_devices_calibrated_rate() -> None:
    """A calibrated device's host sums the gradients sent down at its measured rate; a preset's at the estimate
    from its Adam rate (7/3 of it); the sent gradients' backward time follows."""
    from cost_models.devices import get_device
    from planner.api import validate_space
    from planner.search.problem import memory_tiers

    space, spec = validate_space(1, "1GB", 8, "V100-32GB", None, "adam", "fp32", None, None, 60.0)
    preset = get_device(spec)
    calibrated = dataclasses.replace(preset, host_grad_sum_params_per_s=5e9)
    mode = StateMode(0, StateTier.HOST, grads_on_host=True)
    estimated, measured = (memory_tiers(device, space, mode, activations=False) for device in (preset, calibrated))
    assert estimated.host_sum_ms_per_param == pytest.approx(1e3 / (preset.host_optimizer_params_per_s * 7 / 3))
    assert measured.host_sum_ms_per_param == pytest.approx(1e3 / 5e9)
    unit = Unit(("a",), 1.0, 1.0, 16_000, 4000, 0, 0, (), 4000, 8000, 1000, 0, 0, largest_own_param_numel=500)
    backward = []
    for tiers in (estimated, measured):
        problem = PipelineProblem((unit,), (), (), Layout.pipeline(1), ScheduleKind.GPIPE, 1, (1,), (),
                                  (LinearCost(0.0, 0.0),), 10**6, tiers)
        backward.append(evaluate(cost_model(problem), ()).parts[0].bwd_ms)
    assert backward[0] - backward[1] == pytest.approx(1000 * (estimated.host_sum_ms_per_param
                                                               - measured.host_sum_ms_per_param))


def test_device_optimizer_step_from_its_bytes_or_from_the_measured_step() -> None:
    """Adam in fp32 on the device, 1000 parameters in 3 tensors. Unmeasured: it reads and writes the weights
    (2 x 4000 bytes) and the moments (2 x 8000) and reads the gradients (4000), 28,000 bytes at 0.0005 ms
    per byte. Measured at 20 us per tensor and 10 ns per parameter: 0.06 + 0.01 ms; with two ZeRO-1
    copies each copy steps a shard of every tensor (half the parameters, all 3 tensors)."""
    unit = dataclasses.replace(Unit(("a",), 1.0, 1.0, 16_000, 4000, 0, 0, (), 4000, 8000, 1000, 0, 0),
                               param_tensors=3)
    problem = PipelineProblem((unit,), (), (), Layout.pipeline(1), ScheduleKind.GPIPE, 1, (1,), (),
                              (LinearCost(0.0, 0.0),), 10**6, _tiers(False, False))
    assert evaluate(cost_model(problem), ()).parts[0].optimizer_ms == pytest.approx(14.0)
    tiers = dataclasses.replace(_tiers(False, False), device_step=OptimizerStepCost(20.0, 10.0))
    measured = dataclasses.replace(problem, tiers=tiers)
    assert evaluate(cost_model(measured), ()).parts[0].optimizer_ms == pytest.approx(0.06 + 0.01)
    sharded = dataclasses.replace(measured, layout=Layout.pipeline(1, 2), allreduce=(LinearCost(0.0, 0.0),),
                                  tiers=dataclasses.replace(tiers, state=StateMode(1, StateTier.GPU)))
    # (the all-gather of the updated shards is free on this link)
    assert evaluate(cost_model(sharded), ()).parts[0].optimizer_ms == pytest.approx(0.06 + 0.005)


def test_the_simulator_replays_swaps() -> None:
    """One stage, GPipe, 2 micro-batches: F 1 ms, B 2 ms, 100 bytes kept and 50 swapped each way in 3 ms.

    F0 0-1 with its copy out 0-3; SWAP_OUT0 waits until 3; F1 3-4 with its copy out 3-6; SWAP_OUT1
    waits until 6; SWAP_IN0 and SWAP_IN1 copy back 6-9 and 9-12; B0 9-11, B1 12-14.
    """
    schedule = gpipe(1, 2)
    programs = schedule.layout.rank_programs(lower(insert_swaps(schedule.programs, {0}), schedule.layout, set()))
    stage = StageCosts(1.0, 2.0, 100, 1000, swap_bytes=50, swap_ms=3.0)
    result = simulate(programs, schedule.layout, SimCosts((stage,), {}))
    assert result.step_ms == 14.0
    # at most: static + both micro-batches' kept bytes + one swapped set (the other is on the host)
    assert result.peak_mem_bytes == (1000 + 2 * 100 + 2 * 50,)


def _tiny(mem: str | int, **overrides):
    arguments = dict(gpus=2, batch_size=8, device="V100-16GB", reserve=0,
                     example_inputs=torch.empty(1, 32, dtype=torch.long, device="meta"))
    arguments.update(overrides)
    return plan(gpt_tiny(), mem=mem, **arguments)


def test_a_budget_nothing_fits_is_told_the_budget_keeping_every_activation_and_the_floor_recompute_reaches() -> None:
    """It named only the budget that fits keeping every activation ("Give mem >= X"): a user gave X where
    recompute fits in much less (ResNet-50, batch 64, on 2 V100s: told 192.4 MiB, and 150 MB fits). The least
    budget that fits, found by bisection through plan(), lies between the floor it names and that budget."""
    def kib(text: str, pattern: str) -> float:
        number, unit = re.search(pattern + r"([\d.]+) (\w?)iB", text).groups()  # type: ignore[union-attr]
        return float(number) * 1024 ** " KMG".index(unit or " ") / 1024

    with pytest.raises(PlanInfeasible) as raised:
        _tiny(1)
    text = str(raised.value)
    kept, floor = kib(text, r"Give mem >= "), kib(text, r"though not below ")
    assert "(it fits keeping every activation; recomputing and swapping them may fit in less" in text
    assert floor < kept and (kept - 0.1 * 1024) * 1024 < raised.value.min_mem_bytes <= kept * 1024  # (shown
    # rounded up to a tenth of a MiB)
    refused, fits = floor * 0.995, kept * 1.005
    with pytest.raises(PlanInfeasible):
        _tiny(f"{refused:.0f}KB")
    for _ in range(6):
        middle = (refused + fits) / 2
        try:
            _tiny(f"{middle:.0f}KB")
            fits = middle
        except PlanInfeasible:
            refused = middle
    assert floor <= fits < kept, (floor, fits, kept)


def test_the_search_keeps_the_optimizer_on_the_host_when_model_state_does_not_fit() -> None:
    with pytest.raises(PlanInfeasible) as raised:
        _tiny(1, offload=False)
    need = raised.value.min_mem_bytes
    offloaded = _tiny(int(0.8 * need), offload=("host",))
    assert all(stage.offload.optimizer_state is StateTier.HOST for stage in offloaded.stages)
    assert "optimizer on host bought the fit" in offloaded.solver.why  # (or the speed: interleaved has no DP)
    assert max(offloaded.predicted.peak_mem_bytes) <= int(0.8 * need)
    text = str(offloaded)
    assert f"stages 0-{len(offloaded.stages) - 1}: optimizer on host" in text and "host memory per node" in text
    roundtrip = Plan.from_dict(json.loads(offloaded.to_json()))
    assert roundtrip.stages[0].offload == offloaded.stages[0].offload
    assert _tiny("1GB", offload=False).stages[0].offload == OffloadSpec()


def test_schema_2_offload_maps_upgrade_to_regions_and_swaps() -> None:
    plan_2 = json.loads(_tiny("1GB", offload=False, data_parallel=(2,)).to_json())  # one stage: every node
    plan_2["schema_version"] = 2
    nodes = plan_2["stages"][0]["nodes"]
    for stage in plan_2["stages"]:
        stage["offload"] = {"activations": {}, "optimizer_state": "gpu", "params": "gpu"}
    plan_2["stages"][0]["offload"]["activations"] = {nodes[8]: "recompute", nodes[9]: "host", nodes[10]: "keep"}
    upgraded = Plan.from_dict(plan_2)
    assert upgraded.schema_version == 3
    assert upgraded.stages[0].offload == OffloadSpec(recompute=((nodes[8],),), swap=(nodes[9],))


def test_offload_invariants_name_the_field() -> None:
    data = json.loads(_tiny("1GB", offload=False).to_json())
    nodes = data["stages"][0]["nodes"]
    data["stages"][0]["offload"]["recompute"] = [[nodes[3], nodes[5]]]
    with pytest.raises(Exception, match=r"stages\[0\].offload.recompute\[0\] is not a run of consecutive"):
        Plan.from_dict(data)
    data["stages"][0]["offload"]["recompute"] = [["no_such_node"]]
    with pytest.raises(Exception, match=r"names nodes \['no_such_node'\]"):
        Plan.from_dict(data)
    data["stages"][0]["offload"]["recompute"] = []
    data["stages"][0]["offload"]["zero_stage"] = 5
    with pytest.raises(Exception, match="zero_stage is 5"):
        Plan.from_dict(data)


def test_a_run_of_recomputed_units_in_one_block_keeps_only_its_first_inputs() -> None:
    """Units 0-3 form one block, unit 4 the next: recomputing 0 and 1 keeps unit 0's 200 input bytes
    only; recomputing 3 and 4 keeps both inputs (the block boundary starts a new region)."""
    unit = Unit(("a",), 2.0, 3.0, 100, 0, 1000, 10, (), 0, 0, 0, 1000, 200)
    problem = PipelineProblem((unit,) * 5, (50,) * 4, (), Layout.pipeline(1), ScheduleKind.GPIPE, 1, (1,), (),
                              (LinearCost(0.0, 0.0),), 10**6, _tiers())
    costs = cost_model(problem)

    def saved(recompute: tuple[float, ...]) -> int:
        return evaluate(costs, (), Decisions(recompute, (0.0,) * 5)).parts[0].activation_bytes

    kept = saved((0.0,) * 5)
    assert kept - saved((1.0, 1.0, 0.0, 0.0, 0.0)) == 2000 - 200
    assert kept - saved((0.0, 0.0, 0.0, 1.0, 1.0)) == 2000 - 2 * 200


def test_host_memory_the_plan_needs_beyond_the_node_is_named() -> None:
    with pytest.raises(PlanInfeasible) as raised:
        _tiny(1, offload=False)
    with pytest.raises(PlanInfeasible, match=r"node 0 would need .* of host memory .* and has 1\.0 KiB; give "
                                             r"--host-mem \(plan\(host_mem=\)\) >= ") as host:
        _tiny(int(0.8 * raised.value.min_mem_bytes), offload=("host",), host_mem="1KB")
    assert host.value.binding == "host memory of node 0"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 5)), min_size=1, max_size=6), min_size=1,
                max_size=5), st.floats(-1, 40))
def test_row_interpolation_is_numpys_per_row(steps: list[list[tuple[float, float]]], shift: float) -> None:
    """The fractional knapsack's curves are read per row at once as np.interp reads each row."""
    width = max(len(row) for row in steps) + 1
    xp = np.array([np.cumsum([0.0] + [a for a, _ in row] + [0.0] * (width - 1 - len(row))) for row in steps])
    fp = np.array([np.cumsum([0.0] + [a * b for a, b in row] + [0.0] * (width - 1 - len(row))) for row in steps])
    x = np.linspace(-1.0, 1.0, len(steps)) + shift
    expected = [np.interp(x[r], xp[r], fp[r]) for r in range(len(steps))]
    np.testing.assert_allclose(_row_interp(x, xp, fp), expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("on_gpu_fits", "said"), [
    (False, "optimizer on host bought the fit: no plan keeping everything on the GPU fits"),
    (True, "optimizer on host bought the speed: no plan keeping everything on the GPU could come within 1% of it"),
    (None, ("optimizer on host bought the fit or the speed: no plan keeping everything on the GPU fits, or could "
            "come within 1% of it"))])
def test_the_why_line_says_fit_only_when_nothing_on_the_gpu_fits(on_gpu_fits: bool | None, said: str) -> None:
    """A plan keeping everything on the GPU that fits but was cut off by its lower bound is not "no fit"."""
    from types import SimpleNamespace

    from planner.search.search import SearchResult

    state = SimpleNamespace(describe=lambda: "optimizer on host")
    best = SimpleNamespace(evaluation=SimpleNamespace(decisions=None), setup=SimpleNamespace(
        config=SimpleNamespace(state=state)))
    result = SearchResult(best, None, 3, 1, 0.1, on_gpu_fits=on_gpu_fits)  # type: ignore[arg-type]
    assert result.offload_note().startswith(said)


def test_a_budget_only_memory_decisions_fit_names_the_host_memory_they_need_not_a_larger_gpu() -> None:
    """Keeping every activation the GPUs need more than the budget, recomputing they fit, and host memory holds
    the optimizer: the error named the GPU budget that keeps every activation (which the host memory did not
    fit either) where the host memory was short. It names what host memory the plan needs, and that fits."""
    from examples.models.gpt import gpt

    model = gpt(hidden=64, layers=4, heads=4, seq_len=512, vocab=512, dropout=0.0)
    arguments = {"gpus": 2, "batch_size": 8, "device": "V100-16GB", "reserve": 0,
                 "example_inputs": torch.empty(1, 512, dtype=torch.long, device="meta")}
    with pytest.raises(PlanInfeasible) as kept:
        plan(model, mem=1, offload=("host",), **arguments)
    mem = int(0.6 * kept.value.min_mem_bytes)
    with pytest.raises(PlanInfeasible, match=r"if it recomputes or swaps activations .* node 0 would need .* of host "
                                             r"memory .* has 1\.0 KiB; give --host-mem") as short:
        plan(model, mem=mem, offload=("host", "recompute"), host_mem="1KB", **arguments)
    assert short.value.binding == "host memory of node 0" and short.value.min_mem_bytes <= mem
    need_mib = float(re.search(r"would need ([\d.]+) MiB", str(short.value)).group(1))
    made = plan(model, mem=mem, offload=("host", "recompute"), host_mem=f"{need_mib + 0.1}MB", **arguments)
    assert max(made.predicted.peak_mem_bytes) <= mem
