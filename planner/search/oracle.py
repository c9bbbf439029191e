"""Exact dynamic programs over the same costs as the ILP: the test oracle and the memory floor.

``optimal_partition`` enumerates, for every (stage, last unit) state, the Pareto set of
(sum of transfer times, bottleneck, largest all-reduce) over all feasible prefixes; the step time
is monotone in each, so the optimum is kept exactly. ``min_peak_partition`` minimises the
largest per-stage memory (used to say how much memory an infeasible budget lacks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.search.objective import Evaluation, evaluate, pace_ms, stage_summary
from planner.search.problem import PipelineProblem

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
    """The partition whose largest per-stage peak memory is smallest (memory budget ignored).

    A min-max DP over (stage, last unit); each stage's memory for every possible first unit is
    computed as one vector (numpy), so a 16-stage, 150-unit problem takes milliseconds.
    """
    num_units, num_stages = len(problem.units), problem.num_stages
    memory = _SegmentMemory(problem)
    best = memory.first_stage_peaks(num_units - num_stages)  # best[last]: stage 0 ends at last
    choices: list[np.ndarray] = []
    for stage in range(1, num_stages):
        remaining = num_stages - stage - 1
        following = np.full(num_units, np.inf)
        choice = np.zeros(num_units, dtype=int)
        for last in range(stage, num_units - remaining):
            firsts = np.arange(stage, last + 1)  # stage covers first..last; previous ends at first-1
            value = np.maximum(best[firsts - 1], memory.stage_peaks(stage, firsts, last))
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
    return OracleResult(tuple(cuts), evaluate(problem, tuple(cuts)))


class _SegmentMemory:
    """Vectorised peak memory of a stage over units first..last (as objective.stage_summary)."""

    def __init__(self, problem: PipelineProblem) -> None:
        units = problem.units
        self.problem = problem
        self.state = np.concatenate([[0.0], np.cumsum([u.state_bytes for u in units], dtype=float)])
        self.act = np.concatenate([[0.0], np.cumsum([u.activation_bytes for u in units], dtype=float)])
        self.transient = np.array([u.transient_bytes for u in units], dtype=float)
        self.boundary = np.array(problem.boundary_bytes, dtype=float)
        self.next_use = [self._next_use([q in u.shared for u in units]) for q in range(len(problem.shared))]

    @staticmethod
    def _next_use(used: list[bool]) -> np.ndarray:
        """next_use[f]: the first unit at or after f using the parameter (len(used) if none)."""
        following = np.full(len(used) + 1, len(used))
        for index in range(len(used) - 1, -1, -1):
            following[index] = index if used[index] else following[index + 1]
        return following

    def stage_peaks(self, stage: int, firsts: np.ndarray, last: int) -> np.ndarray:
        problem = self.problem
        transient = np.maximum.accumulate(self.transient[firsts[0]:last + 1][::-1])[::-1]
        sent = self.boundary[last] if stage < problem.num_stages - 1 else 0.0
        received = self.boundary[firsts - 1] if stage > 0 else np.zeros(len(firsts))
        static = self.state[last + 1] - self.state[firsts] + transient[firsts - firsts[0]] + sent
        for q, next_use in enumerate(self.next_use):
            static = static + (next_use[firsts] <= last) * problem.shared[q].state_bytes
        activation = self.act[last + 1] - self.act[firsts] + received
        return static + problem.in_flight[stage] * activation

    def first_stage_peaks(self, last_max: int) -> np.ndarray:
        """Stage 0 starting at unit 0 and ending at each last in 0..last_max (inf beyond)."""
        values = np.full(len(self.problem.units), np.inf)
        for last in range(last_max + 1):
            values[last] = self.stage_peaks(0, np.array([0]), last)[0]
        return values
