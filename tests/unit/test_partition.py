"""The partition ILP against the exact dynamic program, on random instances and on zoo models."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.devices import get_device
from cost_models.memory import Optimizer, get_precision
from examples.models.amoebanet import amoebanet_d
from examples.models.gpt import gpt_tiny
from examples.models.resnet import resnet50
from examples.models.unet import unet_small
from planner import trace
from planner.plan import Layout, ScheduleKind
from planner.search.evaluate import evaluate, term_matrix, term_value, weighted_matrix
from planner.search.ilp import SolveStatus, solve_partition
from planner.search.oracle import decided_step_floor, min_peak_partition, optimal_partition
from planner.search.problem import LinearCost, PipelineProblem, SharedParam, Unit
from planner.search.search import Config, Search, SearchSpace
from planner.search.terms import CostModel, cost_model

SHARED = (SharedParam("tied.weight", 700, 100), SharedParam("other", 300, 50))


@st.composite
def problems(draw) -> PipelineProblem:
    num_units = draw(st.integers(1, 11))
    num_stages = draw(st.integers(1, min(num_units, 5)))
    microbatches = draw(st.integers(1, 8))
    ms = st.floats(0.0, 10.0, allow_nan=False)
    nbytes = st.integers(0, 1000)
    units = tuple(Unit((f"n{i}",), draw(ms), draw(ms), draw(nbytes), draw(st.integers(0, 300)),
                       draw(nbytes), draw(st.integers(0, 300)),
                       tuple(draw(st.sets(st.sampled_from([0, 1]), max_size=2))))
                  for i in range(num_units))
    in_flight = tuple(draw(st.sampled_from([microbatches, min(microbatches, num_stages - s)]))
                      for s in range(num_stages))
    links = tuple(LinearCost(draw(st.floats(0, 1)), draw(st.floats(0, 0.01)))
                  for _ in range(num_stages - 1))
    allreduce = tuple(LinearCost(draw(st.floats(0, 1)), draw(st.floats(0, 0.01))) for _ in range(num_stages))
    return PipelineProblem(units, tuple(draw(nbytes) for _ in range(num_units - 1)), SHARED,
                           Layout.pipeline(num_stages), draw(st.sampled_from([k for k in ScheduleKind if k.closed_form])),
                           microbatches, in_flight, links, allreduce, draw(st.integers(500, 8000)))


def _brute_force(costs: CostModel) -> float | None:
    best = None
    problem = costs.problem
    for cuts in itertools.combinations(range(len(problem.units) - 1), problem.num_parts - 1):
        evaluation = evaluate(costs, cuts)
        if evaluation.fits(problem.mem_bytes) and (best is None or evaluation.step_ms < best):
            best = evaluation.step_ms
    return best


@settings(max_examples=300, deadline=None)
@given(problems())
def test_ilp_equals_exact_dynamic_program(problem: PipelineProblem) -> None:
    _check_ilp_equals_dp(problem)


def test_ilp_solves_a_problem_whose_heuristic_point_breaks_a_row_by_the_tolerance() -> None:
    """CI's random draw found it: HiGHS's feasibility-jump point broke a row by 1e-6, HiGHS then rejected
    its own optimum ("solve error") and pulp reported no solution, while the DP finds cuts (2, 4)."""
    backward_ms = (1.9513405642658834, 1.775608395925281, 1.6825125441555757, 1.0, 0.0, 0.0)
    units = tuple(Unit((f"n{i}",), 0.0, ms, 0, 0, 390 if i == 2 else 0, 1 if i == 4 else 0, ())
                  for i, ms in enumerate(backward_ms))
    links = (LinearCost(0.48046182591729203, 0.0078125), LinearCost(0.0, 0.0078125))
    allreduce = (LinearCost(0.28482792916640115, 0.0), LinearCost(1.0, 0.0), LinearCost(0.0, 0.0))
    problem = PipelineProblem(units, (0, 0, 1, 2, 0), SHARED, Layout.pipeline(3), ScheduleKind.GPIPE, 8, (3, 8, 8),
                              links, allreduce, 3107)
    assert solve_partition(cost_model(problem)).cuts == (2, 4)
    _check_ilp_equals_dp(problem)


def _check_ilp_equals_dp(problem: PipelineProblem) -> None:
    costs = cost_model(problem)
    result = solve_partition(costs)
    oracle = optimal_partition(costs)
    assert (oracle is None) == (result.status is SolveStatus.INFEASIBLE)
    if oracle is None:
        assert _brute_force(costs) is None
        return
    assert result.status is SolveStatus.OPTIMAL
    exact = oracle.evaluation.step_ms
    assert result.objective == pytest.approx(exact, rel=1e-6, abs=1e-6)
    chosen = evaluate(costs, result.cuts)
    assert chosen.step_ms == pytest.approx(result.objective, rel=1e-6, abs=1e-6)
    assert chosen.fits(problem.mem_bytes)
    assert exact == pytest.approx(_brute_force(costs), rel=1e-9, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(problems())
def test_the_step_floor_of_plans_keeping_every_activation_is_below_the_best_that_fits(
        problem: PipelineProblem) -> None:
    """What lets the search skip a configuration's ILP: without memory decisions, the step floor is at
    most the fastest partition that fits (brute force), and inf exactly when none fits."""
    costs = cost_model(problem)
    floor = decided_step_floor(costs)
    best = _brute_force(costs)
    assert (floor == float("inf")) == (best is None)
    if best is not None:
        assert floor <= best + 1e-9


def test_the_step_floor_counts_the_bottleneck_that_memory_forces() -> None:
    """Where the budget keeps the units that save most apart, no even split fits and some part must be the
    bottleneck, though not any one part in particular: the floor that lets the search skip the ILP is the
    best partition that fits (brute force), where the sums and each part's pace alone gave 62 ms of its
    209 (ResNet-1001 at 1024x1024 on 13 stages: 1,874 ms bounded so, 5,452 ms the optimum)."""
    costs_ms = ((0, 1), (3, 6), (4, 3), (4, 5), (4, 3), (4, 5), (0, 1), (2, 3), (3, 3), (1, 0))
    saved = (300, 10, 10, 10, 100, 100, 300, 100, 100, 300)
    units = tuple(Unit((f"n{i}",), float(fwd), float(bwd), 0, 0, nbytes, 0)
                  for i, ((fwd, bwd), nbytes) in enumerate(zip(costs_ms, saved)))
    free = LinearCost(0.0, 0.0)
    problem = PipelineProblem(units, (0,) * 9, (), Layout.pipeline(3), ScheduleKind.ONE_F_ONE_B, 8, (3, 2, 1),
                              (free,) * 2, (free,) * 3, 2000)
    costs = cost_model(problem)
    best = _brute_force(costs)
    assert best == pytest.approx(209.0)
    assert decided_step_floor(costs) == pytest.approx(best)
    assert decided_step_floor(costs, enough_ms=0.99 * best) >= 0.99 * best  # as the search asks: enough?


@settings(max_examples=100, deadline=None)
@given(problems())
def test_min_peak_partition_is_the_memory_floor(problem: PipelineProblem) -> None:
    costs = cost_model(problem)
    floor = min_peak_partition(costs).evaluation.peak_mem_bytes
    every = [evaluate(costs, cuts).peak_mem_bytes for cuts in
             itertools.combinations(range(len(problem.units) - 1), problem.num_parts - 1)]
    assert floor == min(every)


@settings(max_examples=100, deadline=None)
@given(problems())
def test_term_matrix_agrees_with_each_part(problem: PipelineProblem) -> None:
    """The scalar and the vectorised evaluation of every term on every range are the same arithmetic."""
    costs = cost_model(problem)
    terms = [(part, term) for part, named in enumerate(costs.parts) for term in named.values()]
    terms += [(part, term) for row in costs.memory for part, term in row.members]
    count, checked = len(problem.units), 0
    for part, term in terms:
        many = term_matrix(costs, term)
        for first, last in itertools.combinations_with_replacement(range(count), 2):
            if term.starts_after and first == 0 or term.ends_after and last == count - 1:
                continue
            assert many[first, last] == pytest.approx(term_value(costs, term, first, last), rel=1e-12, abs=1e-9)
            checked += 1
    assert checked > 0


@settings(max_examples=60, deadline=None)
@given(problems(), st.lists(st.floats(-2.0, 3.0), min_size=1, max_size=6))
def test_a_weighted_sum_of_terms_is_one_matrix(problem: PipelineProblem, weights: list[float]) -> None:
    """weighted_matrix sums a part's terms (maxima over units included) as their scalar values do."""
    costs = cost_model(problem)
    count = len(problem.units)
    for part, named in enumerate(costs.parts):
        weighted = list(zip(named.values(), weights * len(named)))
        many = weighted_matrix(costs, weighted)
        for first, last in itertools.combinations_with_replacement(range(count), 2):
            if any(term.starts_after and first == 0 or term.ends_after and last == count - 1 for term, _ in weighted):
                continue
            expected = sum(weight * term_value(costs, term, first, last) for term, weight in weighted)
            assert many[first, last] == pytest.approx(expected, rel=1e-9, abs=1e-6)
        for low, high in itertools.combinations(range(count + 1), 2):  # blocks of it: what a window bound reads
            firsts, lasts = range(low, high), range(count - high, count - low)
            assert np.array_equal(weighted_matrix(costs, weighted, firsts, lasts), many[low:high, count - high:count - low])


ZOO = {
    "resnet50": lambda: (resnet50(), torch.empty(1, 3, 224, 224, device="meta")),
    "amoebanet": lambda: (amoebanet_d(num_layers=6, num_filters=64), torch.empty(1, 3, 224, 224, device="meta")),
    "unet": lambda: (unet_small(), torch.empty(1, 3, 256, 256, device="meta")),
    "gpt": lambda: (gpt_tiny(), torch.empty(1, 32, dtype=torch.long, device="meta")),
}


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ilp_equals_dynamic_program_on_zoo_models(name: str, schedule: str) -> None:
    model, x = ZOO[name]()
    graph = trace(model, x)
    kind = ScheduleKind(schedule)
    space = SearchSpace(gpus=8, gpus_per_node=4, mem_bytes=16 * 2**30, global_batch_size=32,
                        optimizer=Optimizer.ADAM, precision=get_precision("fp32"), schedules=(kind,),
                        max_units=24, offload=frozenset())
    search = Search(graph, get_device("V100-16GB"), space)
    for config in (Config(4, 2, 2, 8, kind), Config(8, 1, 4, 8, kind)):
        costs = search.setup(config).costs
        result = solve_partition(costs)
        oracle = optimal_partition(costs)
        assert result.objective == pytest.approx(oracle.evaluation.step_ms, rel=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ilp_equals_dynamic_program_when_memory_binds_at_real_scale(schedule: str) -> None:
    """Budgets of tens of GiB and byte-sized coefficients: the ILP must not lose plans to tolerances."""
    from dataclasses import replace

    from examples.models.gpt import gpt

    graph = trace(gpt(hidden=1024, layers=8, heads=16, seq_len=512),
                  torch.empty(1, 512, dtype=torch.long, device="meta"))
    kind = ScheduleKind(schedule)
    space = SearchSpace(gpus=8, gpus_per_node=8, mem_bytes=80 * 2**30, global_batch_size=16,
                        optimizer=Optimizer.ADAM, precision=get_precision("fp32"), schedules=(kind,), offload=frozenset())
    search = Search(graph, get_device("A100-80GB"), space)
    setup = search.setup(Config(8, 1, 2, 8, kind))
    floor = min_peak_partition(setup.costs).evaluation.peak_mem_bytes
    tight = cost_model(replace(setup.problem, mem_bytes=int(floor * 1.03)))
    result = solve_partition(tight)
    oracle = optimal_partition(tight)
    assert result.objective == pytest.approx(oracle.evaluation.step_ms, rel=1e-9)
    assert evaluate(tight, result.cuts).fits(tight.problem.mem_bytes)


@pytest.mark.parametrize("max_units", [4, 16, 1000])
def test_every_unit_computes_something_so_that_every_stage_can_be_built(max_units: int) -> None:
    """A unit of the U-Net's output node alone (the cheapest cut, before it: only the head's small output
    crosses) made a 3-stage plan whose last stage held no computation, which the runtime refuses. Units of
    inputs, parameters or the output alone join their neighbour; by hand, the input and the output cannot
    stand alone however fine the units are."""
    from cost_models import estimate
    from cost_models.graph.ir import NodeKind
    from planner.search.problem import coarsen

    graph = trace(unet_small(), torch.zeros(2, 3, 32, 32))
    table = estimate(graph, "A100-40GB", "momentum", "fp32")
    units = coarsen(graph, table, get_precision("fp32"), Optimizer.MOMENTUM, max_units).units
    idle = (NodeKind.INPUT, NodeKind.PARAM, NodeKind.OUTPUT)
    assert all(any(graph.node(name).kind not in idle for name in unit.nodes) for unit in units)
    assert units[-1].nodes[-1] == "output" and len(units[-1].nodes) > 1
    assert [name for unit in units for name in unit.nodes] == [node.name for node in graph]


@pytest.mark.parametrize("max_units", [8, 1000])
def test_no_unit_boundary_cuts_a_value_that_cannot_cross_a_stage_boundary(max_units: int) -> None:
    """Attention splits its projection into a tuple (q, k, v), which the runtime cannot send between stages;
    after a profile made the cut behind ``split`` the cheapest, a 2-stage GPT plan could not run. Units
    never end between a tuple-making node and its last reader, however fine they are (the cheapest
    crossing there or not); a manual stage start there is a one-line error naming where to start instead."""
    from cost_models import estimate
    from cost_models.graph.shapes import crosses_boundary
    from planner.manual import plan_with_split
    from planner.search.problem import coarsen, staying_values

    model, tokens = gpt_tiny(), torch.zeros(2, 32, dtype=torch.long)
    graph = trace(model, tokens)
    splits = [node.name for node in graph if not node.crosses]
    assert splits and all(node.target.endswith("split") for node in graph if node.name in splits)
    assert crosses_boundary((2, 3)) and crosses_boundary(torch.ones(1)) and crosses_boundary(None)
    assert not crosses_boundary((torch.ones(1), torch.ones(1))) and not crosses_boundary([torch.ones(1)])
    table = estimate(graph, "A100-40GB", "momentum", "fp32")
    units = coarsen(graph, table, get_precision("fp32"), Optimizer.MOMENTUM, max_units).units
    staying = staying_values(graph)
    position = {node.name: index for index, node in enumerate(graph)}
    ends = [position[unit.nodes[-1]] for unit in units[:-1]]
    assert ends and all(staying[end] is None for end in ends)
    spans = [(position[name], position[graph.users[name][-1]]) for name in splits]
    assert all(staying[index] == name for name, (first, last) in zip(splits, spans) for index in range(first, last))
    inside = graph.nodes[spans[0][0] + 1].name  # the first getitem of the first split
    with pytest.raises(ValueError, match=f"stage_starts '{inside}' cuts while '{splits[0]}'"):
        plan_with_split(model, example_inputs=tokens, stage_starts=[inside], batch_size=4, micro_batch_size=2)
