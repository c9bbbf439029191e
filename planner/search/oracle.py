"""Exact dynamic programs over a cost model's terms: the test oracle of the ILP and the memory floor.

Both need every memory row to depend on one part only, which holds when every slot runs one
stage (GPipe, 1F1B); :func:`check_exact` says so otherwise. ``optimal_partition`` keeps, for every
(part, first unit) state, the Pareto set of label vectors: per piece of the objective the partition
changes, its running sum or maximum, and for a drain its suffix flow, suffix pace and best value so
far. The step is increasing in each, so the optimum is kept exactly. ``min_peak_partition``
minimises the largest memory row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.search.evaluate import Evaluation, evaluate, term_matrix, term_value
from planner.search.terms import Aggregate, CostModel, Drain, MemoryRow, Reduce, Term, fixed_sum

_Label = tuple[tuple[float, ...], tuple[int, ...]]  # (piece values so far, cuts so far)


@dataclass(frozen=True)
class OracleResult:
    cuts: tuple[int, ...]
    evaluation: Evaluation
    peak_bytes: int = 0  # min_peak_partition: the smallest largest row (of the rows it minimised)


def check_exact(costs: CostModel, *, decisions_allowed: bool = False) -> None:
    """Raise ValueError unless every memory row depends on a single part (what the DPs need) and,
    unless ``decisions_allowed``, the model has no memory decisions (the DPs place cuts only)."""
    shared = [row.slot for row in costs.memory if len({part for part, _ in row.members}) != 1]
    if shared:
        raise ValueError(f"slots {shared} hold several parts; the exact dynamic programs handle layouts "
                         f"with one stage per slot only")
    if costs.decides and not decisions_allowed:
        raise ValueError("the model decides recompute, swap and state tiers; the dynamic programs place "
                         "cuts only (the ILP decides)")


def optimal_partition(costs: CostModel) -> OracleResult | None:
    """The minimum-step-time feasible partition, or None if no partition fits the memory.

    Parts are placed from the last to the first (a drain sums and maximises over suffixes); the
    state is the first unit of the parts placed so far, the label each varying piece's running value.
    """
    check_exact(costs)
    pieces = [piece for piece in costs.objective if isinstance(piece, Drain)
              or (piece.members and fixed_sum(piece, costs.num_parts) is None)]
    fixed = sum(piece.weight * (fixed_sum(piece, costs.num_parts) or 0.0) for piece in costs.objective
                if isinstance(piece, Aggregate))
    start: tuple[float, ...] = tuple(v for piece in pieces for v in _initial(piece))
    frontier: dict[int, list[_Label]] = {costs.num_units: [(start, ())]}
    for part in reversed(range(costs.num_parts)):
        members = [_members_of(piece, part) for piece in pieces]
        rows = [[term for _, term in row.members] for row in costs.memory if row.members[0][0] == part]
        following: dict[int, list[_Label]] = {}
        for next_first, labels in frontier.items():
            for first in range(part, next_first):  # the parts before this one need a unit each
                contribution = _part_contribution(costs, members, rows, first, next_first - 1)
                if contribution is None:
                    continue
                cut = (first - 1,) if part else ()
                for values, cuts in labels:
                    following.setdefault(first, []).append((_fold(pieces, values, contribution), cut + cuts))
        frontier = {first: _pareto(labels) for first, labels in following.items()}
    labels = frontier.get(0, [])
    if not labels:
        return None
    best = min(labels, key=lambda label: fixed + _objective(pieces, label[0]))
    return OracleResult(best[1], evaluate(costs, best[1]))


_Members = tuple[list[Term], ...]  # an aggregate's terms on one part, or a drain's (flow, pace, tail) terms


def _members_of(piece: Aggregate | Drain, part: int) -> _Members:
    groups = (piece.flow, piece.pace, piece.tail) if isinstance(piece, Drain) else (piece.members,)
    return tuple([term for member, term in group if member == part] for group in groups)


def _initial(piece: Aggregate | Drain) -> tuple[float, ...]:
    return (0.0, 0.0, float("-inf")) if isinstance(piece, Drain) else (0.0,)


def _part_contribution(costs: CostModel, members: list[_Members], rows: list[list[Term]], first: int,
                       last: int) -> list[tuple[float, ...]] | None:
    """Per piece, its terms' values on a part holding units first..last (sums; the pace a maximum);
    None if one of the part's memory ``rows`` does not fit."""
    for terms in rows:
        if sum(term_value(costs, term, first, last) for term in terms) > costs.problem.mem_bytes:
            return None
    contribution = []
    for groups in members:
        values = [[term_value(costs, term, first, last) for term in group] for group in groups]
        if len(groups) == 3:  # a drain: flow, pace, tail
            contribution.append((sum(values[0]), max(values[1], default=0.0), sum(values[2])))
        else:
            contribution.append((sum(values[0]), max(values[0], default=0.0)))
    return contribution


def _fold(pieces: list[Aggregate | Drain], values: tuple[float, ...],
          contribution: list[tuple[float, ...]]) -> tuple[float, ...]:
    """The label after adding one part (placed before the parts already in ``values``)."""
    merged: list[float] = []
    offset = 0
    for piece, part in zip(pieces, contribution):
        if isinstance(piece, Drain):
            flow, pace, best = values[offset:offset + 3]
            flow, pace = flow + part[0], max(pace, part[1])
            merged += [flow, pace, max(best, flow + piece.pace_weight * pace + part[2])]
            offset += 3
        else:
            total = values[offset] + part[0] if piece.reduce is Reduce.SUM else max(values[offset], part[1])
            merged.append(total)
            offset += 1
    return tuple(merged)


def _objective(pieces: list[Aggregate | Drain], values: tuple[float, ...]) -> float:
    total, offset = 0.0, 0
    for piece in pieces:
        width = 3 if isinstance(piece, Drain) else 1
        total += piece.weight * values[offset + width - 1]
        offset += width
    return total


def _pareto(labels: list[_Label]) -> list[_Label]:
    kept: list[_Label] = []
    for label in sorted(labels, key=lambda lab: lab[0]):
        if not any(all(k <= v for k, v in zip(other[0], label[0])) for other in kept):
            kept.append(label)
    return kept


def min_peak_partition(costs: CostModel) -> OracleResult:
    """The partition whose largest memory row is smallest (the budget ignored).

    A min-max DP over (part, last unit); each part's memory for every (first, last) unit is one
    numpy matrix, so a 16-part, 150-unit problem takes milliseconds. With memory decisions, the rows
    minimised have every decision at its most frugal (``costs.frugal_memory``): ``peak_bytes`` is
    then a lower bound of what any decisions need (without them, the exact peak).
    """
    check_exact(costs, decisions_allowed=True)
    rows = costs.frugal_memory
    num_units, num_parts = costs.num_units, costs.num_parts
    units = np.arange(num_units)
    matrices: dict[int, np.ndarray] = {}  # per term (parts share terms)
    best = np.where(units <= num_units - num_parts, _peak_matrix(costs, rows, 0, matrices)[0], np.inf)
    choices: list[np.ndarray] = []
    for part in range(1, num_parts):
        remaining = num_parts - part - 1
        before = np.concatenate(([np.inf], best[:-1]))  # before[first]: the best up to unit first - 1
        value = np.maximum(before[:, None], _peak_matrix(costs, rows, part, matrices))
        value[(units[:, None] > units[None, :]) | (units[:, None] < part)] = np.inf  # first <= last, first >= part
        choice = np.argmin(value, axis=0)  # the lowest first among equals
        best = np.where((units >= part) & (units < num_units - remaining), value[choice, units], np.inf)
        choices.append(choice)
    cuts: list[int] = []
    last = num_units - 1
    for choice in reversed(choices):
        first = int(choice[last])
        cuts.append(first - 1)
        last = first - 1
    cuts.reverse()
    return OracleResult(tuple(cuts), evaluate(costs, tuple(cuts)), round(float(best[num_units - 1])))


def _peak_matrix(costs: CostModel, rows: tuple[MemoryRow, ...], part: int,
                 matrices: dict[int, np.ndarray]) -> np.ndarray:
    """The largest memory row of ``part`` holding units first..last, at [first, last] (each term's
    matrix computed once in ``matrices``)."""
    def matrix(term: Term) -> np.ndarray:
        if id(term) not in matrices:
            matrices[id(term)] = term_matrix(costs, term)
        return matrices[id(term)]

    peaks = np.zeros((costs.num_units, costs.num_units))
    for row in rows:
        if row.members[0][0] == part:
            peaks = np.maximum(peaks, sum(matrix(term) for _, term in row.members))
    return peaks
