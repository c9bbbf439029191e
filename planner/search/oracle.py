"""Exact dynamic programs over a cost model's terms: the test oracle of the ILP and the memory floor.

Both need every memory row to depend on one part only, which holds when every slot runs one
stage (GPipe, 1F1B); :func:`check_exact` says so otherwise. ``optimal_partition`` keeps, for every
(part, last unit) state, the Pareto set of label vectors (one entry per aggregate the partition
changes: the running sum, or the running maximum); the step is increasing in each, so the optimum
is kept exactly. ``min_peak_partition`` minimises the largest memory row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.search.evaluate import Evaluation, evaluate, term_value, term_values
from planner.search.terms import Aggregate, CostModel, Reduce, Term, fixed_sum

_Label = tuple[tuple[float, ...], tuple[int, ...]]  # (aggregate values so far, cuts so far)


@dataclass(frozen=True)
class OracleResult:
    cuts: tuple[int, ...]
    evaluation: Evaluation


def check_exact(costs: CostModel) -> None:
    """Raise ValueError unless every memory row depends on a single part (what the DPs need)."""
    shared = [row.slot for row in costs.memory if len({part for part, _ in row.members}) != 1]
    if shared:
        raise ValueError(f"slots {shared} hold several parts; the exact dynamic programs handle layouts "
                         f"with one stage per slot only")


def optimal_partition(costs: CostModel) -> OracleResult | None:
    """The minimum-step-time feasible partition, or None if no partition fits the memory."""
    check_exact(costs)
    varying = [a for a in costs.objective if fixed_sum(a, costs.num_parts) is None and a.members]
    fixed = sum(a.weight * (fixed_sum(a, costs.num_parts) or 0.0) for a in costs.objective)
    num_units, num_parts = costs.num_units, costs.num_parts
    frontier: dict[int, list[_Label]] = {-1: [(tuple(0.0 for _ in varying), ())]}
    for part in range(num_parts):
        remaining = num_parts - part - 1
        members = [[term for member, term in aggregate.members if member == part] for aggregate in varying]
        rows = [[term for _, term in row.members] for row in costs.memory if row.members[0][0] == part]
        following: dict[int, list[_Label]] = {}
        for previous_last, labels in frontier.items():
            for last in range(previous_last + 1, num_units - remaining):
                contribution = _part_contribution(costs, varying, members, rows, previous_last + 1, last)
                if contribution is None:
                    continue
                for values, cuts in labels:
                    merged = tuple(v + c if a.reduce is Reduce.SUM else max(v, c)
                                   for a, v, c in zip(varying, values, contribution))
                    following.setdefault(last, []).append((merged, cuts + ((last,) if remaining else ())))
        frontier = {last: _pareto(labels) for last, labels in following.items()}
    labels = frontier.get(num_units - 1, [])
    if not labels:
        return None
    best = min(labels, key=lambda label: fixed + sum(a.weight * v for a, v in zip(varying, label[0])))
    return OracleResult(best[1], evaluate(costs, best[1]))


def _part_contribution(costs: CostModel, varying: list[Aggregate], members: list[list[Term]],
                       rows: list[list[Term]], first: int, last: int) -> tuple[float, ...] | None:
    """Each varying aggregate's value over the part's ``members``; None if one of its memory ``rows``
    does not fit."""
    for terms in rows:
        if sum(term_value(costs, term, first, last) for term in terms) > costs.problem.mem_bytes:
            return None
    contribution = []
    for aggregate, terms in zip(varying, members):
        values = [term_value(costs, term, first, last) for term in terms]
        if aggregate.reduce is Reduce.SUM:
            contribution.append(sum(values))
        else:
            contribution.append(max(values, default=0.0))
    return tuple(contribution)


def _pareto(labels: list[_Label]) -> list[_Label]:
    kept: list[_Label] = []
    for label in sorted(labels, key=lambda lab: lab[0]):
        if not any(all(k <= v for k, v in zip(other[0], label[0])) for other in kept):
            kept.append(label)
    return kept


def min_peak_partition(costs: CostModel) -> OracleResult:
    """The partition whose largest memory row is smallest (the budget ignored).

    A min-max DP over (part, last unit); each part's memory for every possible first unit is one
    numpy vector, so a 16-part, 150-unit problem takes milliseconds.
    """
    check_exact(costs)
    num_units, num_parts = costs.num_units, costs.num_parts
    best = _row_peaks(costs, 0, np.array([0]), range(num_units - num_parts + 1), num_units)
    choices: list[np.ndarray] = []
    for part in range(1, num_parts):
        remaining = num_parts - part - 1
        following = np.full(num_units, np.inf)
        choice = np.zeros(num_units, dtype=int)
        for last in range(part, num_units - remaining):
            firsts = np.arange(part, last + 1)  # part covers first..last; the previous ends at first-1
            value = np.maximum(best[firsts - 1], _part_peaks(costs, part, firsts, last))
            pick = int(np.argmin(value))
            following[last], choice[last] = value[pick], firsts[pick]
        best = following
        choices.append(choice)
    cuts: list[int] = []
    last = num_units - 1
    for choice in reversed(choices):
        first = int(choice[last])
        cuts.append(first - 1)
        last = first - 1
    cuts.reverse()
    return OracleResult(tuple(cuts), evaluate(costs, tuple(cuts)))


def _part_peaks(costs: CostModel, part: int, firsts: np.ndarray, last: int) -> np.ndarray:
    """The largest memory row of ``part`` holding units firsts[k]..last, for every k."""
    peaks = np.zeros(len(firsts))
    for row in costs.memory:
        if row.members[0][0] == part:
            peaks = np.maximum(peaks, sum(term_values(costs, term, firsts, last) for _, term in row.members))
    return peaks


def _row_peaks(costs: CostModel, part: int, firsts: np.ndarray, lasts: range, num_units: int) -> np.ndarray:
    """Part ``part`` starting at firsts[0] and ending at each of ``lasts`` (inf elsewhere)."""
    values = np.full(num_units, np.inf)
    for last in lasts:
        values[last] = _part_peaks(costs, part, firsts, last)[0]
    return values
