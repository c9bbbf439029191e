"""The partition ILP in pulp: variables, one function per constraint family, solving, status.

done[i, s] = 1 when unit i runs on stage s or an earlier one. Stages are contiguous in
topological order because done never increases along the units (and never decreases along
the stages); unit i runs on stage s when x[i, s] = done[i, s] - done[i, s-1] = 1, and
cut[p, s] = done[p, s] - done[p + 1, s] is 1 exactly when stage s ends after unit p. The objective is
the step time of planner.search.objective, linearised with bottleneck variables. This is the only module
that imports pulp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

import pulp

from planner.search.problem import PipelineProblem


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
    done: dict[tuple[int, int], Any]
    memory: dict[int, pulp.LpConstraint]


def default_solver(time_limit_s: float | None = None, cutoff_ms: float | None = None) -> Any:
    """HiGHS through its Python API when installed, CBC otherwise; exact (zero relative gap).

    ``cutoff_ms`` (HiGHS only) stops the search as soon as it is proven that no plan of this
    configuration beats that step time; the result is then NO_SOLUTION.
    """
    if "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        options = {} if cutoff_ms is None else {"objective_bound": cutoff_ms}
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=0.0, threads=1, **options)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=0.0, threads=1)


def solve_partition(problem: PipelineProblem, solver: Any | None = None,
                    time_limit_s: float | None = None, cutoff_ms: float | None = None) -> IlpResult:
    """Build the ILP for ``problem`` and solve it with ``solver`` (default: HiGHS or CBC)."""
    model = build_model(problem)
    solver = solver or default_solver(time_limit_s, cutoff_ms)
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
    done = _prefix_variables(lp, num_units, num_stages)
    x = {(i, s): done[i, s] - done[i, s - 1] for i in range(num_units) for s in range(num_stages)}
    cut = {(p, s): done[p, s] - done[p + 1, s]
           for p in range(num_units - 1) for s in range(num_stages - 1)}
    _contiguity(lp, done, num_units, num_stages)
    _nonempty(lp, x, num_units, num_stages)
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
    return _Model(lp, done, memory)


def _prefix_variables(lp: pulp.LpProblem, num_units: int, num_stages: int) -> dict:
    """done[i, s] = 1 when unit i runs on stage s or earlier; done[i, -1] = 0, done[i, S-1] = 1.

    Branching on "is unit i finished by stage s" splits the search evenly, which proves
    optimality far faster than branching on single assignments x[i, s].
    """
    done: dict[tuple[int, int], Any] = {}
    for i in range(num_units):
        done[i, -1] = 0
        done[i, num_stages - 1] = 1
        for s in range(num_stages - 1):
            done[i, s] = lp.add_variable(f"done_{i}_{s}", cat="Binary")
    return done


def _contiguity(lp: pulp.LpProblem, done: dict, num_units: int, num_stages: int) -> None:
    """Stages are contiguous runs of units in topological order, numbered in that order.

    done[., s] is a prefix of ones; with every stage non-empty the prefixes grow with s, so
    done[i, s] <= done[i, s + 1] holds without stating it.
    """
    for s in range(num_stages - 1):
        for i in range(num_units - 1):
            lp += done[i, s] >= done[i + 1, s], f"order_{i}_{s}"
    if num_stages > 1:
        lp += done[0, 0] == 1, "first_unit_on_first_stage"
        lp += done[num_units - 1, num_stages - 2] == 0, "last_unit_on_last_stage"


def _nonempty(lp: pulp.LpProblem, x: dict, num_units: int, num_stages: int) -> None:
    for s in range(num_stages):
        lp += pulp.lpSum(x[i, s] for i in range(num_units)) >= 1, f"nonempty_{s}"


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
    """Static state + transient + send buffer + in-flight x (activations + received) <= budget.

    Rows are written in units of the budget (coefficients of order 1), not bytes (order 1e10),
    which would leave the solver's tolerances larger than real differences between plans.
    """
    scale = 1.0 / problem.mem_bytes
    constraints = {}
    boundary = range(len(problem.units) - 1)
    for s in range(problem.num_stages):
        transient = lp.add_variable(f"transient_{s}", lowBound=0)
        for i, unit in enumerate(problem.units):
            if unit.transient_bytes:
                lp += transient >= unit.transient_bytes * scale * x[i, s], f"transient_{s}_{i}"
        sent = (pulp.lpSum(cut[p, s] * problem.boundary_bytes[p] * scale for p in boundary)
                if s < problem.num_stages - 1 else 0)
        received = (pulp.lpSum(cut[p, s - 1] * problem.boundary_bytes[p] * scale for p in boundary)
                    if s > 0 else 0)
        static = (pulp.lpSum(x[i, s] * u.state_bytes * scale for i, u in enumerate(problem.units))
                  + pulp.lpSum(shared_on[q, s] * p.state_bytes * scale for q, p in enumerate(problem.shared))
                  + transient + sent)
        activation = pulp.lpSum(x[i, s] * u.activation_bytes * scale
                                for i, u in enumerate(problem.units)) + received
        lp += static + problem.in_flight[s] * activation <= 1.0, f"memory_stage_{s}"
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
    """Unit indices where a stage ends: the last unit with done[., s] = 1, for every s < S-1."""
    num_units = len(problem.units)
    return tuple(max(i for i in range(num_units) if _is_one(model.done[i, s]))
                 for s in range(problem.num_stages - 1))


def _is_one(value: Any) -> bool:
    return (value.value() if hasattr(value, "value") else value) > 0.5


def _gap(lp: pulp.LpProblem) -> float:
    return 0.0 if lp.sol_status == pulp.LpSolutionOptimal else float("nan")


def _binding(model: _Model, problem: PipelineProblem) -> str:
    used = {s: 1.0 + (constraint.value() or 0.0) for s, constraint in model.memory.items()}
    stage = max(used, key=lambda s: used[s])
    return f"memory_stage_{stage} ({used[stage]:.0%} of the budget)"
