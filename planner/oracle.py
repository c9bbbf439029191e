"""Exact dynamic programs over the same costs as the ILP: the test oracle and the memory floor.

``optimal_partition`` enumerates, for every (stage, last unit) state, the Pareto set of
(sum of transfer times, bottleneck, largest all-reduce) over all feasible prefixes; the step time
is monotone in each, so the optimum is kept exactly. ``min_peak_partition`` minimises the
largest per-stage memory (used to say how much memory an infeasible budget lacks).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.objective import Evaluation, evaluate, pace_ms, stage_summary
from planner.problem import PipelineProblem

_Label = tuple[float, float, float, tuple[int, ...]]  # (sum send ms, bottleneck, max allreduce, cuts)


@dataclass(frozen=True)
class OracleResult:
    cuts: tuple[int, ...]
    evaluation: Evaluation


def optimal_partition(problem: PipelineProblem) -> OracleResult | None:
    """The minimum-step-time feasible partition, or None if no partition fits the memory."""
    num_units, num_stages = len(problem.units), problem.num_stages
    frontier: dict[int, list[_Label]] = {}
    for last in range(num_units - num_stages + 1):
        label = _extend(problem, (0.0, 0.0, 0.0, ()), 0, 0, last)
        if label is not None:
            frontier[last] = [label]
    for stage in range(1, num_stages):
        frontier = _next_frontier(problem, frontier, stage)
    labels = frontier.get(num_units - 1, [])
    if not labels:
        return None
    total_compute = sum(unit.fwd_ms + unit.bwd_ms for unit in problem.units)
    best = min(labels, key=lambda label: _objective(problem, total_compute, label))
    return OracleResult(best[3], evaluate(problem, best[3]))


def _next_frontier(problem: PipelineProblem, frontier: dict[int, list[_Label]],
                   stage: int) -> dict[int, list[_Label]]:
    num_units, remaining = len(problem.units), problem.num_stages - stage - 1
    following: dict[int, list[_Label]] = {}
    for previous_last, labels in frontier.items():
        for last in range(previous_last + 1, num_units - remaining):
            for label in labels:
                extended = _extend(problem, label, stage, previous_last + 1, last)
                if extended is not None:
                    following.setdefault(last, []).append(extended)
    return {last: _pareto(labels) for last, labels in following.items()}


def _extend(problem: PipelineProblem, label: _Label, stage: int, first: int, last: int) -> _Label | None:
    summary = stage_summary(problem, stage, first, last)
    if summary.peak_mem_bytes > problem.mem_bytes:
        return None
    sends, bottleneck, allreduce, cuts = label
    new_cuts = cuts + (last,) if stage < problem.num_stages - 1 else cuts
    return (sends + summary.send_ms, max(bottleneck, pace_ms(summary)),
            max(allreduce, summary.allreduce_ms), new_cuts)


def _pareto(labels: list[_Label]) -> list[_Label]:
    kept: list[_Label] = []
    for label in sorted(labels, key=lambda lab: lab[:3]):
        if not any(k[0] <= label[0] and k[1] <= label[1] and k[2] <= label[2] for k in kept):
            kept.append(label)
    return kept


def _objective(problem: PipelineProblem, total_compute: float, label: _Label) -> float:
    sends, bottleneck, allreduce, _ = label
    return total_compute + 2 * sends + (problem.num_microbatches - 1) * bottleneck + allreduce


def min_peak_partition(problem: PipelineProblem) -> OracleResult:
    """The partition whose largest per-stage peak memory is smallest (memory budget ignored)."""
    num_units, num_stages = len(problem.units), problem.num_stages
    best: dict[int, tuple[int, tuple[int, ...]]] = {}
    for last in range(num_units - num_stages + 1):
        best[last] = (stage_summary(problem, 0, 0, last).peak_mem_bytes, (last,))
    for stage in range(1, num_stages):
        remaining = num_stages - stage - 1
        following: dict[int, tuple[int, tuple[int, ...]]] = {}
        for previous_last, (peak, cuts) in best.items():
            for last in range(previous_last + 1, num_units - remaining):
                value = max(peak, stage_summary(problem, stage, previous_last + 1, last).peak_mem_bytes)
                if last not in following or value < following[last][0]:
                    following[last] = (value, cuts + (last,))
        best = following
    _, cuts = best[num_units - 1]
    cuts = cuts[:-1]
    return OracleResult(cuts, evaluate(problem, cuts))
