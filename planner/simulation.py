"""Replay a plan's programs on its own predicted costs (the numbers `tessera simulate` shows)."""

from __future__ import annotations

from typing import Sequence

from planner.plan import Plan, StagePlan, Transfer
from planner.schedules.actions import StageMap, parse_programs
from planner.schedules.simulate import SimCosts, SimResult, StageCosts, simulate


def sim_costs(stages: Sequence[StagePlan], transfers: Sequence[Transfer], data_parallel: int) -> SimCosts:
    """Stage compute, memory and all-reduce from the predictions; transfers per stage pair."""
    costs = tuple(StageCosts(s.predicted.fwd_ms, s.predicted.bwd_ms,
                             s.predicted.activation_bytes // max(1, s.predicted.in_flight),
                             s.predicted.static_bytes,
                             s.predicted.allreduce_ms if data_parallel > 1 else 0.0)
                  for s in stages)
    return SimCosts(costs, {(t.src_stage, t.dst_stage): t.ms for t in transfers})


def pipeline_programs(plan: Plan) -> tuple[tuple[str, ...], ...]:
    """The programs of the first replica, one per stage (rank = stage * data_parallel + replica)."""
    return tuple(plan.programs[stage.ranks[0]] for stage in plan.stages)


def simulate_plan(plan: Plan) -> SimResult:
    programs = parse_programs(pipeline_programs(plan))
    return simulate(programs, StageMap.identity(plan.num_stages),
                    sim_costs(plan.stages, plan.transfers, plan.data_parallel))
