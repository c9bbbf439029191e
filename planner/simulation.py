"""Replay a plan's programs on its own predicted costs (what `plan()` predicts, `tessera simulate` shows)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from cost_models.comm import p2p_post_ms
from cost_models.device_spec import LinkSpec
from planner.plan import Layout, Plan, ScheduleKind, StagePlan, TiedSum, Transfer
from planner.schedules.actions import parse_programs
from planner.schedules.simulate import SimCosts, SimResult, StageCosts, simulate


def sim_costs(layout: Layout, parts: Sequence[StagePlan], transfers: Sequence[Transfer],
              kind: ScheduleKind, backend: str, tied_sums: Sequence[TiedSum]) -> SimCosts:
    """Each stage costs what its part is predicted to (its all-reduce overlapping its last backward where
    the runtime's does on ``backend``); transfers, and what posting them costs, per stage pair; the tied
    weights' gradient sums (required: a plan's replay that forgot them would make its tied models' waits free)."""
    stale = kind.stale_parts(layout.num_parts)
    stages = tuple(parts[layout.part(stage)] for stage in range(layout.num_stages))
    shared = _shared_copies(layout, tied_sums)
    costs = tuple(StageCosts(p.fwd_ms, p.bwd_ms, p.activation_bytes, p.static_bytes - min(state, p.static_bytes),
                             p.allreduce_ms, p.optimizer_ms, p.swap_bytes, p.swap_ms, p.weight_grad_ms,
                             p.allreduce_overlap(part.offload, part.index in stale or kind.splits_backward, backend),
                             p.grad_bytes - min(grads, p.grad_bytes), p.step_bytes, p.tied_bytes, p.accumulate_bytes,
                             p.split_extra_ms, p.first_backward_bytes, p.split_kept_bytes, p.split_relief_bytes)
                  for stage, part in enumerate(stages) for p in [part.predicted]
                  for state, grads in [shared.get(stage, (0, 0))])
    return SimCosts(costs, {(t.src_stage, t.dst_stage): t.ms for t in transfers},
                    {(t.src_stage, t.dst_stage): t.post_ms for t in transfers}, tuple(tied_sums))


def _shared_copies(layout: Layout, tied_sums: Sequence[TiedSum]) -> dict[int, tuple[int, int]]:
    """Per stage whose slot runs an earlier stage holding the same tied weights, the state and gradient bytes of the
    copy it does not hold: a rank keeps one tensor, the earliest of its stages' (runtime/stages.py: local_stages),
    whose gradient the others' backwards add into."""
    held: dict[int, tuple[int, int]] = {}
    for tied in tied_sums:
        for slot in range(layout.num_slots):
            for stage in sorted(s for s in layout.stages_on_slot(slot) if layout.part(s) in tied.parts)[1:]:
                state, grads = held.get(stage, (0, 0))
                held[stage] = (state + tied.state_bytes, grads + (tied.nbytes if tied.state_bytes else 0))
    return held


def simulate_plan(plan: Plan) -> SimResult:
    """The plan's per-rank programs replayed on its predicted costs."""
    costs = sim_costs(plan.layout, plan.stages, plan.transfers, plan.schedule.kind, plan.cluster.backend,
                      plan.tied_sums)
    return simulate(parse_programs(plan.programs), plan.layout, costs)


def simulate_measured(plan: Plan, action_ms: Sequence[Mapping[str, float]]) -> SimResult:
    """The plan's programs replayed on compute times a run measured: per rank, per "stage:kind" (as the
    run report's ``rank_action_ms`` holds them) the time of one action, averaged over the ranks running
    the stage, and what a message took apart from waiting (its "post", averaged over the ranks) where the plan costs
    posts; transfers, all-reduces, tied sums and swaps as predicted. It tells the schedule's bubble on the run's own
    compute, apart from how well the costs were predicted."""
    def measured(key: str, default: float) -> float:
        times = [ranks[key] for ranks in action_ms if key in ranks]
        return sum(times) / len(times) if times else default

    predicted = sim_costs(plan.layout, plan.stages, plan.transfers, plan.schedule.kind, plan.cluster.backend,
                          plan.tied_sums)
    planned_post_ms = p2p_post_ms(LinkSpec.from_dict(plan.cluster.device["intra_node"]))  # per message
    posts = measured("post", planned_post_ms) / planned_post_ms if planned_post_ms else 1.0  # measured/planned
    stages = []
    for stage, costs in enumerate(predicted.stages):
        weight_grad_ms = measured(f"{stage}:W", 0.0)
        backward_ms = measured(f"{stage}:B", measured(f"{stage}:I", 0.0) + weight_grad_ms)
        stages.append(dataclasses.replace(costs, fwd_ms=measured(f"{stage}:F", costs.fwd_ms), bwd_ms=backward_ms,
                                          weight_grad_ms=weight_grad_ms, split_extra_ms=0.0,  # in the measured I
                                          optimizer_ms=measured(f"{stage}:OPTIMIZER_STEP", costs.optimizer_ms)))
    replayed = dataclasses.replace(predicted, stages=tuple(stages),
                                   post_ms={edge: ms * posts for edge, ms in predicted.post_ms.items()})
    return simulate(parse_programs(plan.programs), plan.layout, replayed)


def rank_names(layout: Layout) -> list[str]:
    """A label per rank for timelines: ``rank 3: stage 1, replica 1`` (stages it runs, its replica)."""
    def name(rank: int) -> str:
        stages = ", ".join(str(stage) for stage in layout.stages_of_rank(rank))
        label = f"rank {rank}: stage{'s' if ',' in stages else ''} {stages}"
        return label + (f", replica {layout.place(rank).replica}" if layout.data_parallel > 1 else "")
    return [name(rank) for rank in range(layout.world_size)]
