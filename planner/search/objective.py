"""Step time and per-stage memory of one partition: the cost model the ILP and the DP optimise.

For S stages, M micro-batches, per-stage compute u_s = F_s + B_s, forward transfer c_s across
the boundary after stage s (the gradient goes back in the same time on the opposite link) and
gradient all-reduce a_s:

    step = sum_s u_s + 2 * sum_s c_s + (M - 1) * max(max_s u_s, max_s c_s) + max_s a_s

(one micro-batch's path through every stage and link, plus M - 1 more at the pace of the
slowest resource). Under 1F1B a stage cannot start its next forward before its successor has
returned the backward of an earlier micro-batch, so the pace is also at least
u_{s+1} + 2 c_s (the successor's compute plus the round trip) for every boundary s.

Stage s holds its weights, gradients and optimizer state, its largest transient, one outgoing
send buffer, and (activations it saves + inputs it received) for each micro-batch in flight
under the schedule; on the last stage the activations include what the loss keeps for
backward, one tensor the size of the model output (cross-entropy's log-softmax; added to the
unit holding the graph's output in planner/problem.py, so the ILP and the DP see it too).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.search.problem import PipelineProblem


@dataclass(frozen=True)
class StageSummary:
    first_unit: int
    last_unit: int
    fwd_ms: float
    bwd_ms: float
    send_ms: float  # forward transfer time across the boundary after this stage
    cycle_ms: float  # 1F1B round trip through this stage from its predecessor (0 otherwise)
    allreduce_ms: float
    static_bytes: int  # held all step: model state, transient, send buffer
    activation_bytes: int  # per micro-batch in flight: saved activations + received inputs
    grad_bytes: int
    peak_mem_bytes: int

    @property
    def compute_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms


@dataclass(frozen=True)
class Evaluation:
    stages: tuple[StageSummary, ...]
    step_ms: float

    def fits(self, mem_bytes: int) -> bool:
        return all(stage.peak_mem_bytes <= mem_bytes for stage in self.stages)

    @property
    def peak_mem_bytes(self) -> int:
        return max(stage.peak_mem_bytes for stage in self.stages)


def segments(num_units: int, cuts: tuple[int, ...]) -> list[tuple[int, int]]:
    """Cuts (unit indices after which a stage ends) to inclusive (first, last) unit ranges."""
    starts = (0, *(cut + 1 for cut in cuts))
    ends = (*cuts, num_units - 1)
    return list(zip(starts, ends))


def stage_summary(problem: PipelineProblem, stage: int, first: int, last: int) -> StageSummary:
    """Costs of stage ``stage`` holding units ``first..last`` (inclusive)."""
    sums = problem.prefix_sums
    def total(field: str) -> float:
        return sums[field][last + 1] - sums[field][first]
    shared = {index for unit in problem.units[first:last + 1] for index in unit.shared} if problem.shared else set()
    grad_bytes = int(total("grad_bytes")) + sum(problem.shared[i].grad_bytes for i in shared)
    received = problem.boundary_bytes[first - 1] if stage > 0 else 0
    sent = problem.boundary_bytes[last] if stage < problem.num_stages - 1 else 0
    static = (int(total("state_bytes")) + sum(problem.shared[i].state_bytes for i in shared)
              + problem.max_transient(first, last) + sent)
    activation = int(total("activation_bytes")) + received
    send_ms = problem.links[stage].ms(sent) if stage < problem.num_stages - 1 else 0.0
    allreduce_ms = problem.allreduce.fixed_ms + problem.allreduce.ms_per_byte * grad_bytes
    fwd_ms, bwd_ms = total("fwd_ms"), total("bwd_ms")
    cycle_ms = 0.0
    if problem.round_trip and stage > 0:
        cycle_ms = fwd_ms + bwd_ms + 2 * problem.links[stage - 1].ms(received)
    return StageSummary(first, last, fwd_ms, bwd_ms, send_ms, cycle_ms, allreduce_ms, static,
                        activation, grad_bytes, static + problem.in_flight[stage] * activation)


def pace_ms(stage: StageSummary) -> float:
    """The slowest per-micro-batch resource this stage contributes to the bottleneck."""
    return max(stage.compute_ms, stage.send_ms, stage.cycle_ms)


def step_ms(problem: PipelineProblem, stages: tuple[StageSummary, ...]) -> float:
    compute = sum(stage.compute_ms for stage in stages)
    sends = sum(stage.send_ms for stage in stages)
    return (compute + 2 * sends + (problem.num_microbatches - 1) * max(map(pace_ms, stages))
            + max(stage.allreduce_ms for stage in stages))


def evaluate(problem: PipelineProblem, cuts: tuple[int, ...]) -> Evaluation:
    """Evaluate the partition whose stage s ends after unit ``cuts[s]``."""
    if len(cuts) != problem.num_stages - 1 or list(cuts) != sorted(set(cuts)):
        raise ValueError(f"cuts {cuts} must be {problem.num_stages - 1} increasing unit indices")
    stages = tuple(stage_summary(problem, index, first, last)
                   for index, (first, last) in enumerate(segments(len(problem.units), cuts)))
    return Evaluation(stages, step_ms(problem, stages))
