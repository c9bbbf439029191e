"""The partition ILP in pulp, generated from the cost terms: variables, row families, solving, status.

done[i, s] = 1 when unit i runs on part s or an earlier one. Parts are contiguous in
topological order because done never increases along the units (and never decreases along
the parts); unit i runs on part s when x[i, s] = done[i, s] - done[i, s-1] = 1, and
end[p, s] = done[p, s] - done[p + 1, s] is 1 exactly when part s ends after unit p. Every term of
planner/search/terms.py becomes a linear expression over these; a maximum (the bottleneck, the
slowest all-reduce, a part's largest transient) becomes a variable above each of its members.
This module writes no cost formula and is the only one that imports pulp.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import pulp

from planner.search.evaluate import Decisions
from planner.search.problem import block_of
from planner.search.terms import Aggregate, CostModel, Drain, Reduce, Term, fixed_sum


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
    decisions: Decisions | None = None  # the memory decisions (recompute and swap shares may be fractional)


@dataclass
class _Model:
    """The pulp problem and the handles needed to read a solution back."""

    problem: pulp.LpProblem
    done: dict[tuple[int, int], Any]
    memory: dict[str, pulp.LpConstraint]  # by row: "slot 2", "slot 2 at part 1's optimizer step", ...
    variables: _Variables


_STRICT_MIP_FEASIBILITY = 1e-9
"""HiGHS's mip_feasibility_tolerance for a second solve after it rejected its own incumbent (default 1e-6)."""


class InterruptibleHiGHS(pulp.HiGHS):
    """pulp's HiGHS solving in a worker thread, so that Ctrl-C stops it at once.

    A KeyboardInterrupt reaches only the main thread, and never while it is inside HiGHS's C++
    ``run()``; here the main thread waits in short steps instead, and on the interrupt asks
    HiGHS to stop (its user-interrupt callback), waits for the worker, and re-raises.
    """

    def createAndConfigureSolver(self, lp: pulp.LpProblem) -> None:
        with _silenced_stdout():  # HiGHS prints its banner on stdout when the first model is made
            super().createAndConfigureSolver(lp)

    def buildSolverModel(self, lp: pulp.LpProblem) -> None:
        """The model pulp's HiGHS API would pass (its columns, rows, coefficients and bounds, in its
        order), passed as a few arrays instead of a call per column and per row (which cost as much as
        building the model).

        pulp reads the solution back by ``var.index`` (the column: variables sorted by name, as
        ``lp.variables()`` gives them) and ``constraint.index`` (the row: constraints in insertion
        order), so both are set as pulp's own ``buildSolverModel`` sets them; zero coefficients are
        left out as it leaves them out.
        """
        import highspy  # present whenever pulp lists HiGHS as available

        highs, infinity = lp.solverModel, highspy.kHighsInf
        columns = lp.variables()
        sign = -1 if lp.sense == pulp.LpMaximize else 1
        objective = lp.objective
        for index, variable in enumerate(columns):
            variable.index = index
        lower = [-infinity if v.lowBound is None else v.lowBound for v in columns]
        upper = [infinity if v.upBound is None else v.upBound for v in columns]
        cost = [sign * objective.get(v, 0.0) for v in columns]
        integer = [v.index for v in columns if v.cat == pulp.LpInteger] if self.mip else []
        if columns:
            highs.addVars(len(columns), np.array(lower, dtype=np.float64), np.array(upper, dtype=np.float64))
            highs.changeColsCost(len(columns), np.arange(len(columns), dtype=np.int32),
                                 np.array(cost, dtype=np.float64))
        if integer:
            highs.changeColsIntegrality(len(integer), np.array(integer, dtype=np.int32),
                                        np.full(len(integer), highspy.HighsVarType.kInteger.value, dtype=np.uint8))
        rows = lp.constraints()
        starts, indices, values, row_lower, row_upper = [], [], [], [], []
        for index, constraint in enumerate(rows):
            constraint.index = index
            starts.append(len(indices))
            for variable, coefficient in constraint.items():
                if coefficient != 0:
                    indices.append(variable.index)
                    values.append(coefficient)
            low, high = constraint.getLb(), constraint.getUb()
            row_lower.append(-infinity if low is None else low)
            row_upper.append(infinity if high is None else high)
        if rows:
            highs.addRows(len(rows), np.array(row_lower, dtype=np.float64), np.array(row_upper, dtype=np.float64),
                          len(indices), np.array(starts, dtype=np.int32), np.array(indices, dtype=np.int32),
                          np.array(values, dtype=np.float64))

    def callSolver(self, lp: pulp.LpProblem) -> None:
        highs = lp.solverModel
        import highspy  # present whenever pulp lists HiGHS as available

        highs.HandleUserInterrupt = True
        self._solve(highs)
        if highs.getModelStatus() == highspy.HighsModelStatus.kSolveError:
            # HiGHS rejects its own incumbent when a heuristic's point breaks a row by the MIP tolerance
            # (1e-6) and then reports no solution at all; solved again with a tolerance that the
            # heuristics' points must meet, the same model solves (a 6-unit, 3-stage problem did)
            highs.setOptionValue("mip_feasibility_tolerance", _STRICT_MIP_FEASIBILITY)
            self._solve(highs)

    @staticmethod
    def _solve(highs: Any) -> None:
        highs.startSolve()
        try:
            _wait(highs)
        except KeyboardInterrupt:
            highs.cancelSolve()
            _wait(highs)
            raise


@contextlib.contextmanager
def _silenced_stdout() -> Iterator[None]:
    """File descriptor 1 on /dev/null (C++ output bypasses sys.stdout), restored afterwards."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _wait(highs: Any) -> None:
    while not highs.wait(0.05)[0]:
        pass


def default_solver(time_limit_s: float | None = None, cutoff_ms: float | None = None) -> Any:
    """HiGHS through its Python API when installed (interruptible), CBC otherwise; exact (zero gap).

    ``cutoff_ms`` (HiGHS only) stops the search as soon as it is proven that no plan of this
    configuration beats that step time; the result is then NO_SOLUTION.
    """
    if "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        options = {} if cutoff_ms is None else {"objective_bound": cutoff_ms}
        return InterruptibleHiGHS(msg=False, timeLimit=time_limit_s, gapRel=0.0, threads=1, **options)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=0.0, threads=1)


def solve_partition(costs: CostModel, solver: Any | None = None,
                    time_limit_s: float | None = None, cutoff_ms: float | None = None,
                    integral: bool = False, window: Window | None = None) -> IlpResult:
    """Build the ILP of ``costs`` (a configuration's cost terms) and solve it with ``solver``
    (default: HiGHS or CBC). Recompute and swap shares are continuous (a share of a unit's nodes)
    unless ``integral`` (whole units only: exact, slower). ``window`` restricts each cut to a range
    of units (a neighbourhood of a known partition), which keeps models with memory decisions small.
    With ``cutoff_ms`` only a plan strictly faster is returned: otherwise INFEASIBLE (proven that none
    is) or NO_SOLUTION (the time limit came first)."""
    model = build_model(costs, integral, window)
    # pulp hands HiGHS the objective without its constant: the cutoff is on that objective
    offset = model.problem.objective.constant
    solver = solver or default_solver(time_limit_s, None if cutoff_ms is None else cutoff_ms - offset)
    start = time.perf_counter()
    model.problem.solve(solver)
    wall_s = time.perf_counter() - start
    status = _status(model.problem)
    if status in (SolveStatus.INFEASIBLE, SolveStatus.NO_SOLUTION):
        return IlpResult(status, None, None, solver.name, wall_s, float("nan"), "")
    cuts = _cuts(costs, model)
    objective = pulp.value(model.problem.objective)
    if cutoff_ms is not None and objective >= cutoff_ms:
        # HiGHS prunes with the cutoff but still reports a worse plan its heuristics met: none beats it
        status = SolveStatus.INFEASIBLE if status is SolveStatus.OPTIMAL else SolveStatus.NO_SOLUTION
        return IlpResult(status, None, None, solver.name, wall_s, float("nan"), "")
    return IlpResult(status, cuts, float(objective), solver.name, wall_s,
                     _gap(model.problem), _binding(model), model.variables.decisions(cuts))


Window = tuple[tuple[int, int], ...]
"""Per cut s, the (lowest, highest) unit part s may end after."""


def build_model(costs: CostModel, integral: bool = False, window: Window | None = None) -> _Model:
    """The ILP of a cost model: variables, contiguity, then one row family per aggregate and memory row."""
    num_units, num_parts = costs.num_units, costs.num_parts
    lp = pulp.LpProblem("pipeline_partition", pulp.LpMinimize)
    done = _prefix_variables(lp, num_units, num_parts, window)
    _contiguity(lp, done, num_units, num_parts)
    variables = _Variables(lp, costs, done, integral)
    _nonempty(lp, variables.x, num_units, num_parts)
    objective = pulp.lpSum(_drain(lp, variables, piece) if isinstance(piece, Drain) else
                           _aggregate(lp, variables, piece) for piece in costs.objective)
    memory = _memory(lp, variables, costs)
    _capacity(lp, variables, costs)
    lp += objective, "step_ms"
    return _Model(lp, done, memory, variables)


class _Linear:
    """A linear expression being gathered: a constant and a coefficient per pulp variable."""

    def __init__(self, constant: float = 0.0) -> None:
        self.constant = constant
        self.coefficients: dict[Any, float] = {}

    def add(self, value: Any, coefficient: float) -> None:
        """``+ coefficient x value`` (a pulp variable or a number)."""
        if isinstance(value, (int, float)):
            self.constant += coefficient * value
        else:
            self.coefficients[value] = self.coefficients.get(value, 0.0) + coefficient

    def expression(self) -> pulp.LpAffineExpression:
        return pulp.LpAffineExpression(self.coefficients, self.constant)


class _Variables:
    """The decision variables and each term's linear expression over them (scaled as asked).

    x[i, s] = done[i, s] - done[i, s-1]: unit i on part s; end[p, s] = done[p, s] - done[p+1, s]:
    part s ends after unit p; shared[q, s] >= x[i, s] for every unit i using shared parameter q
    (held once per part using it); a term's maximum over units is a variable above each of its
    units' values.

    Memory decisions: recompute[i, s] and swap[i, s], with recompute + swap <= x[i, s], are the
    shares of unit i's saved activations recomputed and swapped when it runs on part s (only for
    the pairs where unit i can be on part s).
    """

    def __init__(self, lp: pulp.LpProblem, costs: CostModel, done: dict, integral: bool = False) -> None:
        self.lp, self.costs, self.integral, self.done = lp, costs, integral, done
        units, parts = range(costs.num_units), range(costs.num_parts)
        self.x = {(i, s): done[i, s] - done[i, s - 1] for i in units for s in parts}
        self._held = tuple(_held_units(self.x, costs.num_units, part) for part in parts)
        self._cut_units = {s: tuple(p for p in range(costs.num_units - 1) if _variable(done[p, s])
                                    or _variable(done[p + 1, s]) or done[p, s] != done[p + 1, s])
                           for s in range(-1, costs.num_parts)}
        self._shared: dict | None = None
        self._maxima: dict[tuple[int, int, float], Any] = {}
        self._decided: dict[str, dict[tuple[int, int], Any]] | None = None

    def expression(self, term: Term, part: int, scale: float = 1.0) -> Any:
        """``scale x term`` on ``part`` as a pulp expression."""
        return self.total(((term, part, scale),))

    def total(self, members: Iterable[tuple[Term, int, float]]) -> pulp.LpAffineExpression:
        """The sum of ``weight x term`` on its part over ``members`` (term, part, weight), its
        coefficients gathered in one dict (pulp's operators would build an expression object per
        product and per sum)."""
        linear = _Linear()
        for term, part, weight in members:
            self._gather(linear, term, part, weight)
        return linear.expression()

    def _gather(self, linear: _Linear, term: Term, part: int, scale: float) -> None:
        """``linear += scale x term`` on ``part``, visiting only the units and cuts the model has
        variables for (the units a window fixes on the part count as one range sum)."""
        linear.constant += scale * term.constant
        done = self.done
        free, fixed, possible = self._held[part]
        if term.per_unit:
            prefix = term.unit_prefix
            for first, stop, value in fixed:
                linear.constant += scale * value * (prefix[stop] - prefix[first])
            for i in free:
                c = term.per_unit[i]
                if c:  # x[i, part] = done[i, part] - done[i, part - 1]
                    linear.add(done[i, part], scale * c)
                    linear.add(done[i, part - 1], -scale * c)
        for cut, coefficients in ((part, term.ends_after), (part - 1, term.starts_after)):
            if coefficients:  # end[p, cut] = done[p, cut] - done[p + 1, cut]
                for p in self._cut_units[cut]:
                    c = coefficients[p]
                    if c:
                        linear.add(done[p, cut], scale * c)
                        linear.add(done[p + 1, cut], -scale * c)
        if any(term.per_shared):
            shared = self.shared()
            for q, c in enumerate(term.per_shared):
                if c:
                    linear.add(shared[q, part], scale * c)
        if term.unit_max:
            linear.add(self._maximum(term, part, scale), 1.0)
        if term.decides:
            decided = self.decided()
            for kind, coefficients in (("recompute", term.per_recompute), ("swap", term.per_swap),
                                       ("start", term.per_start)):
                if coefficients:
                    for i in possible:
                        c = coefficients[i]
                        if c:
                            linear.add(decided[kind][i, part], scale * c)

    def decided(self) -> dict[str, dict[tuple[int, int], Any]]:
        """recompute[i, s] and swap[i, s] (created on first use), each pair at most x[i, s]."""
        if self._decided is None:
            category = "Binary" if self.integral else "Continuous"
            pairs = [(i, s) for (i, s), x in self.x.items() if not isinstance(x, (int, float)) or x]
            self._decided = {kind: {(i, s): self.lp.add_variable(f"{kind}_{i}_{s}", lowBound=0, upBound=1,
                                                                  cat=category) for i, s in pairs}
                             for kind in ("recompute", "swap")}
            for (i, s), recompute in self._decided["recompute"].items():
                self.lp += recompute + self._decided["swap"][i, s] <= self.x[i, s], f"decide_{i}_{s}"
            self._decided["start"] = self._region_starts(self._decided["recompute"])
        return self._decided

    def _region_starts(self, recompute: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any]:
        """start[i, s] >= recompute[i, s] - recompute[i - 1, s] within a block (a region goes on),
        else >= recompute[i, s]: the share of unit i beginning a checkpoint region on part s."""
        starts = {}
        for (i, s), share in recompute.items():
            start = self.lp.add_variable(f"start_{i}_{s}", lowBound=0)
            before = recompute.get((i - 1, s)) if i and block_of(i - 1) == block_of(i) else None
            self.lp += start >= share - (before if before is not None else 0), f"start_{i}_{s}"
            starts[i, s] = start
        return starts

    def decisions(self, cuts: tuple[int, ...]) -> Decisions | None:
        """The solution's decisions (None when the model has none)."""
        if self._decided is None:
            return None
        shares = {kind: tuple(sum(max(0.0, _number(variable)) for (unit, _), variable in self._decided[kind].items()
                                  if unit == i) for i in range(self.costs.num_units))
                  for kind in ("recompute", "swap")}
        return Decisions(shares["recompute"], shares["swap"])
    def shared(self) -> dict:
        if self._shared is None:
            units, shared_params = self.costs.problem.units, self.costs.problem.shared
            self._shared = {(q, s): self.lp.add_variable(f"shared_{q}_{s}", lowBound=0, upBound=1)
                            for q in range(len(shared_params)) for s in range(self.costs.num_parts)}
            for i, unit in enumerate(units):
                for q in unit.shared:
                    for s in range(self.costs.num_parts):
                        self.lp += self._shared[q, s] >= self.x[i, s], f"shared_{q}_{s}_by_{i}"
        return self._shared

    def _maximum(self, term: Term, part: int, scale: float) -> Any:
        key = (id(term), part, scale)
        if key not in self._maxima:
            name = f"{term.max_name}_{part}"
            if name in {existing.name for existing in self._maxima.values()}:
                name += f"_{len(self._maxima)}"
            top = self.lp.add_variable(name, lowBound=0)
            for i in self._held[part][2]:
                value = term.unit_max[i]
                if value:
                    self.lp += top >= scale * value * self.x[i, part], f"{name}_unit_{i}"
            self._maxima[key] = top
        return self._maxima[key]


def _held_units(x: dict, num_units: int, part: int) -> tuple[tuple[int, ...], tuple[tuple[int, int, int], ...],
                                                             tuple[int, ...]]:
    """Which units ``part`` may hold: those whose x[i, part] is a variable, the runs (first, stop,
    value) of units where it is a non-zero constant, and all of them in order."""
    free = tuple(i for i in range(num_units) if _variable(x[i, part]))
    fixed: list[tuple[int, int, int]] = []
    for i in range(num_units):
        value = x[i, part]
        if _variable(value) or not value:
            continue
        if fixed and fixed[-1][1] == i and fixed[-1][2] == value:
            fixed[-1] = (fixed[-1][0], i + 1, value)
        else:
            fixed.append((i, i + 1, value))
    possible = tuple(sorted(free + tuple(i for first, stop, _ in fixed for i in range(first, stop))))
    return free, tuple(fixed), possible


def _prefix_variables(lp: pulp.LpProblem, num_units: int, num_parts: int, window: Window | None) -> dict:
    """done[i, s] = 1 when unit i runs on part s or earlier; done[i, -1] = 0, done[i, P-1] = 1.

    Branching on "is unit i finished by part s" splits the search evenly, which proves
    optimality far faster than branching on single assignments x[i, s]. Outside a ``window``
    done[i, s] is a constant (1 up to the window's lowest cut, 0 after its highest).
    """
    done: dict[tuple[int, int], Any] = {}
    for i in range(num_units):
        done[i, -1] = 0
        done[i, num_parts - 1] = 1
        for s in range(num_parts - 1):
            low, high = window[s] if window else (-1, num_units)
            done[i, s] = 1 if i <= low else 0 if i > high else lp.add_variable(f"done_{i}_{s}", cat="Binary")
    return done


def _contiguity(lp: pulp.LpProblem, done: dict, num_units: int, num_parts: int) -> None:
    """Parts are contiguous runs of units in topological order, numbered in that order.

    done[., s] is a prefix of ones; with every part non-empty the prefixes grow with s, so
    done[i, s] <= done[i, s + 1] holds without stating it.
    """
    for s in range(num_parts - 1):
        for i in range(num_units - 1):
            if _variable(done[i, s]) or _variable(done[i + 1, s]):
                lp += done[i, s] >= done[i + 1, s], f"order_{i}_{s}"
    if num_parts > 1:
        if _variable(done[0, 0]):
            lp += done[0, 0] == 1, "first_unit_on_first_part"
        if _variable(done[num_units - 1, num_parts - 2]):
            lp += done[num_units - 1, num_parts - 2] == 0, "last_unit_on_last_part"


def _variable(value: Any) -> bool:
    return not isinstance(value, (int, float))


def _nonempty(lp: pulp.LpProblem, x: dict, num_units: int, num_parts: int) -> None:
    for s in range(num_parts):
        held = [x[i, s] for i in range(num_units) if _variable(x[i, s]) or x[i, s]]
        if any(_variable(value) for value in held):
            lp += pulp.lpSum(held) >= 1, f"nonempty_{s}"


def _aggregate(lp: pulp.LpProblem, variables: _Variables, aggregate: Aggregate) -> Any:
    """weight x (sum of the members, or a variable above every member).

    A variable is named after its piece of the objective. pulp orders the columns by name, and
    HiGHS proves these models markedly faster with the objective's few continuous variables ahead
    of the done_ binaries (1.6x on the 50B GPT): the pieces are named "bottleneck" and "backward".
    """
    if not aggregate.members:
        return 0
    fixed = fixed_sum(aggregate, variables.costs.num_parts)
    if fixed is not None:
        return aggregate.weight * fixed
    if aggregate.reduce is Reduce.SUM:
        return aggregate.weight * variables.total((term, part, 1.0) for part, term in aggregate.members)
    expressions = [variables.expression(term, part) for part, term in aggregate.members]
    top = lp.add_variable(f"{aggregate.name}_ms", lowBound=0)
    for index, ((part, _), expression) in enumerate(zip(aggregate.members, expressions)):
        lp += top >= expression, f"{aggregate.name}_{index}_part_{part}"
    return aggregate.weight * top


def _drain(lp: pulp.LpProblem, variables: _Variables, drain: Drain) -> Any:
    """weight x R with R >= flow(s..P-1) + pace_weight x pace(s..P-1) + tail(s) for the parts s that
    can set it: part 0 and every part with a tail (a part without one is dominated by part 0).

    flow_s is a variable above part s's flow terms plus flow_{s+1} (the suffix sum); pace_s one
    above part s's pace terms and above pace_{s+1} (the suffix maximum).
    """
    name, parts = drain.name, range(variables.costs.num_parts)
    flows, paces, tails = ({part: [t for p, t in members if p == part] for part in parts}
                           for members in (drain.flow, drain.pace, drain.tail))
    setters = [part for part in parts if part == 0 or any(not _is_zero(t) for t in tails[part])]
    if setters == [0]:  # only the whole pipeline's drain counts: a sum and a maximum over every part
        return drain.weight * (_flow_sum(lp, variables, drain) + variables.total(
            (t, 0, 1.0) for t in tails[0]) + _aggregate(
            lp, variables, Aggregate(name, Reduce.MAX, drain.pace_weight, drain.pace)))
    flow: dict[int, Any] = {}
    for part in reversed(parts):
        flow[part] = lp.add_variable(f"{name}_flow_{part}", lowBound=0)
        own = variables.total((t, part, 1.0) for t in flows[part])
        lp += flow[part] >= own + flow.get(part + 1, 0), f"{name}_flow_{part}"
    pace: dict[int, Any] = {}
    if drain.pace_weight:
        for part in reversed(parts):
            pace[part] = lp.add_variable(f"{name}_pace_{part}", lowBound=0)
            for index, term in enumerate(paces[part]):
                lp += pace[part] >= variables.expression(term, part), f"{name}_pace_{part}_{index}"
            if part + 1 in pace:
                lp += pace[part] >= pace[part + 1], f"{name}_pace_{part}_suffix"
    top = lp.add_variable(f"{name}_ms", lowBound=0)
    for part in setters:
        rate = drain.pace_weight * pace[part] if pace else 0
        tail = variables.total((t, part, 1.0) for t in tails[part])
        lp += top >= flow[part] + rate + tail, f"{name}_from_part_{part}"
    return drain.weight * top


def _flow_sum(lp: pulp.LpProblem, variables: _Variables, drain: Drain) -> Any:
    """The drain's flow summed over every part, one family of like terms at a time (so a family no
    cut changes, the total backward time, is a constant)."""
    families: dict[int, list[tuple[int, Term]]] = {}
    for part, term in drain.flow:
        families.setdefault(id(term.per_unit) if term.unit_only else id(term), []).append((part, term))
    return pulp.lpSum(_aggregate(lp, variables, Aggregate(drain.name, Reduce.SUM, 1.0, tuple(members)))
                      for members in families.values())


def _is_zero(term: Term) -> bool:
    return term.upper_bound() == 0


def _memory(lp: pulp.LpProblem, variables: _Variables, costs: CostModel) -> dict[str, pulp.LpConstraint]:
    """Each slot's memory rows (its compute and its optimizer step) <= budget, by what they are.

    Rows are written in units of the budget (coefficients of order 1), not bytes (order 1e10),
    which would leave the solver's tolerances larger than real differences between plans.
    """
    scale = 1.0 / costs.problem.mem_bytes
    constraints = {}
    for index, row in enumerate(costs.memory):
        name = f"memory_slot_{row.slot}" + ("" if row.moment == "compute" else f"_at_{row.moment}_{index}")
        lp += variables.total((term, part, scale) for part, term in row.members) <= 1.0, name
        part = row.members[0][0]  # a step or accumulate row's own stage comes first
        label = f"slot {row.slot}" + {"compute": "", "recompute": " in a recomputed region's backward",
                                      "backward": " at a backward's end (tied gradients summed)",
                                      "accumulate": f" in a backward of part {part} adding into its gradients",
                                      "split": " after a split backward's I (its W waiting)",
                                      "step": f" at part {part}'s optimizer step"}[row.moment]
        constraints[label] = lp.get_constraint_by_name(name)
    return constraints


def _capacity(lp: pulp.LpProblem, variables: _Variables, costs: CostModel) -> None:
    """Each node's host memory and NVMe: what its ranks put there, at most its capacity (in its units)."""
    for row in costs.capacity:
        if all(_is_zero(member) for _, _, member in row.members):
            continue
        scale = 1.0 / row.capacity_bytes if row.capacity_bytes else 1.0
        used = variables.total((member, part, weight * scale) for part, weight, member in row.members)
        lp += used <= (1.0 if row.capacity_bytes else 0.0), row.name


def _number(variable: Any) -> float:
    return float(variable.value() or 0.0)


def _status(lp: pulp.LpProblem) -> SolveStatus:
    if lp.status == pulp.LpStatusOptimal:
        return SolveStatus.OPTIMAL if lp.sol_status == pulp.LpSolutionOptimal else SolveStatus.FEASIBLE
    if lp.status == pulp.LpStatusInfeasible:
        return SolveStatus.INFEASIBLE
    if lp.sol_status in (pulp.LpSolutionIntegerFeasible,):
        return SolveStatus.FEASIBLE
    return SolveStatus.NO_SOLUTION


def _cuts(costs: CostModel, model: _Model) -> tuple[int, ...]:
    """Unit indices where a part ends: the last unit with done[., s] = 1, for every s < P-1."""
    return tuple(max(i for i in range(costs.num_units) if _is_one(model.done[i, s]))
                 for s in range(costs.num_parts - 1))


def _is_one(value: Any) -> bool:
    return (value.value() if hasattr(value, "value") else value) > 0.5


def _gap(lp: pulp.LpProblem) -> float:
    return 0.0 if lp.sol_status == pulp.LpSolutionOptimal else float("nan")


def _binding(model: _Model) -> str:
    used = {row: 1.0 + (constraint.value() or 0.0) for row, constraint in model.memory.items()}
    row = max(used, key=lambda r: used[r])
    return f"memory of {row} ({used[row]:.0%} of the budget)"
