"""The partition ILP in pulp: variables, one function per constraint family, solving, status.

x[i, s] = 1 when unit i runs on stage s. Stages are contiguous in topological order because
the cumulative assignment A[i, s] = sum_{s' <= s} x[i, s'] never increases along the units;
cut[p, s] = A[p, s] - A[p + 1, s] is 1 exactly when stage s ends after unit p. The objective is
the step time of planner.objective, linearised with bottleneck variables. This is the only module
that imports pulp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

import pulp

from planner.problem import PipelineProblem


class SolveStatus(str, Enum):
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"  # a solution, optimality not proven (time limit)
    INFEASIBLE = "infeasible"
    NO_SOLUTION = "no-solution"  # stopped before finding any


@dataclass(frozen=True)
class IlpResult:
    status: SolveStatus
    cuts: tuple[int, ...] | None
    objective: float | None
    solver: str
    wall_s: float
    gap: float
    binding: str  # name of the tightest memory constraint in the solution


@dataclass
class _Model:
    """The pulp problem and the handles needed to read a solution back."""

    problem: pulp.LpProblem
    x: dict[tuple[int, int], pulp.LpVariable]
    memory: dict[int, pulp.LpConstraint]


def default_solver(time_limit_s: float | None = None) -> Any:
    """HiGHS through its Python API when installed, CBC otherwise; exact (zero relative gap)."""
    if "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=0.0, threads=1)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=0.0, threads=1)


def solve_partition(problem: PipelineProblem, solver: Any | None = None,
                    time_limit_s: float | None = None) -> IlpResult:
    """Build the ILP for ``problem`` and solve it with ``solver`` (default: HiGHS or CBC)."""
    model = build_model(problem)
    solver = solver or default_solver(time_limit_s)
    start = time.perf_counter()
    model.problem.solve(solver)
    wall_s = time.perf_counter() - start
    status = _status(model.problem)
    if status in (SolveStatus.INFEASIBLE, SolveStatus.NO_SOLUTION):
        return IlpResult(status, None, None, solver.name, wall_s, float("nan"), "")
    cuts = _cuts(problem, model)
    objective = pulp.value(model.problem.objective)
    return IlpResult(status, cuts, float(objective), solver.name, wall_s,
                     _gap(model.problem), _binding(model, problem))


def build_model(problem: PipelineProblem) -> _Model:
    num_units, num_stages = len(problem.units), problem.num_stages
    lp = pulp.LpProblem("pipeline_partition", pulp.LpMinimize)
    x = {(i, s): lp.add_variable(f"x_{i}_{s}", cat="Binary")
         for i in range(num_units) for s in range(num_stages)}
    cumulative = {(i, s): pulp.lpSum(x[i, t] for t in range(s + 1))
                  for i in range(num_units) for s in range(num_stages)}
    cut = {(p, s): cumulative[p, s] - cumulative[p + 1, s]
           for p in range(num_units - 1) for s in range(num_stages - 1)}
    _assignment(lp, x, num_units, num_stages)
    _contiguity(lp, cumulative, num_units, num_stages)
    compute = {s: pulp.lpSum(x[i, s] * (u.fwd_ms + u.bwd_ms) for i, u in enumerate(problem.units))
               for s in range(num_stages)}
    sends = {s: pulp.lpSum(cut[p, s] * problem.links[s].ms(problem.boundary_bytes[p])
                           for p in range(num_units - 1)) for s in range(num_stages - 1)}
    bottleneck = _bottleneck(lp, compute, sends, problem.round_trip)
    shared_on = _shared_on_stage(lp, problem, x)
    allreduce = _allreduce(lp, problem, x, shared_on)
    memory = _memory(lp, problem, x, cut, shared_on)
    total_compute = sum(u.fwd_ms + u.bwd_ms for u in problem.units)
    lp += (total_compute + 2 * pulp.lpSum(sends.values())
           + (problem.num_microbatches - 1) * bottleneck + allreduce), "step_ms"
    return _Model(lp, x, memory)


def _assignment(lp: pulp.LpProblem, x: dict, num_units: int, num_stages: int) -> None:
    """Every unit on exactly one stage; every stage non-empty; first and last units pinned."""
    for i in range(num_units):
        lp += pulp.lpSum(x[i, s] for s in range(num_stages)) == 1, f"assign_{i}"
    for s in range(num_stages):
        lp += pulp.lpSum(x[i, s] for i in range(num_units)) >= 1, f"nonempty_{s}"
    lp += x[0, 0] == 1, "first_unit_on_first_stage"
    lp += x[num_units - 1, num_stages - 1] == 1, "last_unit_on_last_stage"


def _contiguity(lp: pulp.LpProblem, cumulative: dict, num_units: int, num_stages: int) -> None:
    """A unit's stage is never earlier than its predecessor's (stages follow topological order)."""
    for i in range(num_units - 1):
        for s in range(num_stages - 1):
            lp += cumulative[i, s] >= cumulative[i + 1, s], f"order_{i}_{s}"


def _bottleneck(lp: pulp.LpProblem, compute: dict, sends: dict, round_trip: bool) -> pulp.LpVariable:
    """The slowest resource per micro-batch: a stage's compute, a link, or (1F1B) a round trip."""
    slowest = lp.add_variable("bottleneck_ms", lowBound=0)
    for s, expression in compute.items():
        lp += slowest >= expression, f"bottleneck_compute_{s}"
    for s, expression in sends.items():
        lp += slowest >= expression, f"bottleneck_link_{s}"
        if round_trip:
            lp += slowest >= compute[s + 1] + 2 * expression, f"bottleneck_round_trip_{s}"
    return slowest


def _allreduce(lp: pulp.LpProblem, problem: PipelineProblem, x: dict, shared_on: dict) -> pulp.LpVariable:
    """The longest data-parallel gradient all-reduce of any stage."""
    longest = lp.add_variable("allreduce_ms", lowBound=0)
    for s in range(problem.num_stages):
        grads = (pulp.lpSum(x[i, s] * u.grad_bytes for i, u in enumerate(problem.units))
                 + pulp.lpSum(shared_on[q, s] * p.grad_bytes for q, p in enumerate(problem.shared)))
        lp += longest >= problem.allreduce.fixed_ms + problem.allreduce.ms_per_byte * grads, f"allreduce_{s}"
    return longest


def _shared_on_stage(lp: pulp.LpProblem, problem: PipelineProblem, x: dict) -> dict:
    """w[q, s] >= x[i, s] for every unit i using shared parameter q: held once per stage."""
    shared_on = {(q, s): lp.add_variable(f"shared_{q}_{s}", lowBound=0, upBound=1)
                 for q in range(len(problem.shared)) for s in range(problem.num_stages)}
    for i, unit in enumerate(problem.units):
        for q in unit.shared:
            for s in range(problem.num_stages):
                lp += shared_on[q, s] >= x[i, s], f"shared_{q}_{s}_by_{i}"
    return shared_on


def _memory(lp: pulp.LpProblem, problem: PipelineProblem, x: dict, cut: dict, shared_on: dict) -> dict:
    """Static state + transient + send buffer + in-flight x (activations + received) <= budget."""
    constraints = {}
    for s in range(problem.num_stages):
        transient = lp.add_variable(f"transient_{s}", lowBound=0)
        for i, unit in enumerate(problem.units):
            if unit.transient_bytes:
                lp += transient >= unit.transient_bytes * x[i, s], f"transient_{s}_{i}"
        boundary = range(len(problem.units) - 1)
        sent = pulp.lpSum(cut[p, s] * problem.boundary_bytes[p] for p in boundary) if s < problem.num_stages - 1 else 0
        received = pulp.lpSum(cut[p, s - 1] * problem.boundary_bytes[p] for p in boundary) if s > 0 else 0
        static = (pulp.lpSum(x[i, s] * u.state_bytes for i, u in enumerate(problem.units))
                  + pulp.lpSum(shared_on[q, s] * p.state_bytes for q, p in enumerate(problem.shared))
                  + transient + sent)
        activation = pulp.lpSum(x[i, s] * u.activation_bytes for i, u in enumerate(problem.units)) + received
        constraint = static + problem.in_flight[s] * activation <= problem.mem_bytes
        lp += constraint, f"memory_stage_{s}"
        constraints[s] = lp.get_constraint_by_name(f"memory_stage_{s}")
    return constraints


def _status(lp: pulp.LpProblem) -> SolveStatus:
    if lp.status == pulp.LpStatusOptimal:
        return SolveStatus.OPTIMAL if lp.sol_status == pulp.LpSolutionOptimal else SolveStatus.FEASIBLE
    if lp.status == pulp.LpStatusInfeasible:
        return SolveStatus.INFEASIBLE
    if lp.sol_status in (pulp.LpSolutionIntegerFeasible,):
        return SolveStatus.FEASIBLE
    return SolveStatus.NO_SOLUTION


def _cuts(problem: PipelineProblem, model: _Model) -> tuple[int, ...]:
    stage_of = [max(range(problem.num_stages), key=lambda s: model.x[i, s].value() or 0.0)
                for i in range(len(problem.units))]
    return tuple(i for i in range(len(stage_of) - 1) if stage_of[i] != stage_of[i + 1])


def _gap(lp: pulp.LpProblem) -> float:
    return 0.0 if lp.sol_status == pulp.LpSolutionOptimal else float("nan")


def _binding(model: _Model, problem: PipelineProblem) -> str:
    slack = {s: -(constraint.value() or 0.0) for s, constraint in model.memory.items()}
    stage = min(slack, key=lambda s: slack[s])
    used = problem.mem_bytes - slack[stage]
    return f"memory_stage_{stage} ({used / problem.mem_bytes:.0%} of the budget)"
