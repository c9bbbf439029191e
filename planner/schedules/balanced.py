"""The bubble a schedule family's programs actually have: their step when every part costs the same.

The search's step model of a family without a closed form (planner/search/terms.py) is scaled by
this replay, so a family is costed by its own programs (what its generator emits), not by a
textbook formula: interleaving, mirrored copies and split backwards each shrink the replayed
bubble by what they really gain for the configuration's stage and micro-batch counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from planner.plan.kinds import ScheduleKind
from planner.schedules.actions import ActionKind, Programs
from planner.schedules.generate import Schedule, generate
from planner.schedules.lower import lower
from planner.schedules.simulate import SimCosts, StageCosts, simulated_step_ms


@dataclass(frozen=True)
class BalancedStep:
    """A schedule replayed with every part costing ``part_ms`` per micro-batch and free transfers."""

    step_ms: float
    part_ms: float  # forward plus backward of one part for one micro-batch
    rank_work: int  # the most (part, micro-batch) forwards one rank runs: its compute is rank_work x part_ms

    @property
    def path_parts(self) -> float:
        """How many parts' worth of one micro-batch the step takes beyond the busiest rank's own
        compute less one part: the step is ``(rank_work - 1 + path_parts) x part_ms``.

        >>> BalancedStep(step_ms=33.0, part_ms=3.0, rank_work=8).path_parts  # 1F1B: 4 stages, 8 micro-batches
        4.0
        """
        return self.step_ms / self.part_ms - (self.rank_work - 1)


def balanced_step(schedule: Schedule, fwd_ms: float, bwd_ms: float, weight_grad_ms: float = 0.0) -> BalancedStep:
    """Replay ``schedule`` (one replica) with every stage costing ``fwd_ms`` and ``bwd_ms`` per micro-batch
    (``weight_grad_ms`` of it a split backward's W) and transfers free.

    >>> from planner.schedules.generate import interleaved_one_f_one_b, one_f_one_b
    >>> balanced_step(one_f_one_b(4, 8), 1.0, 2.0).step_ms  # (M + S - 1) x 3
    33.0
    >>> step = balanced_step(interleaved_one_f_one_b(8, 8, virtual_stages=2), 1.0, 2.0)
    >>> step.rank_work, step.path_parts  # (M v - 1 + ranks) parts: the bubble shrinks v-fold
    (16, 4.0)
    """
    layout = schedule.layout
    if fwd_ms + bwd_ms <= 0:
        raise ValueError(f"a part must cost time to replay a schedule, got fwd_ms={fwd_ms}, bwd_ms={bwd_ms}")
    programs, rank_work = _replayed(schedule)
    stage = StageCosts(fwd_ms, bwd_ms, 0, 0, weight_grad_ms=weight_grad_ms)
    step_ms = simulated_step_ms(programs, layout, SimCosts((stage,) * layout.num_stages, {}))
    return BalancedStep(step_ms, fwd_ms + bwd_ms, rank_work)


@functools.lru_cache(maxsize=256)
def _family_replay(kind: ScheduleKind, num_parts: int, num_microbatches: int, fwd_ms: float, bwd_ms: float,
                   weight_grad_ms: float, options: tuple[tuple[str, Any], ...]) -> BalancedStep:
    """:func:`balanced_step` of ``kind``'s programs, cached: configurations with more micro-batches than a family
    replays (its extension: :func:`family_step`) share one replay (BERT-large on 16 V100s asks for 104, 56 of them
    distinct)."""
    return balanced_step(generate(kind, num_parts, num_microbatches, **dict(options)), fwd_ms, bwd_ms, weight_grad_ms)


@functools.lru_cache(maxsize=64)
def _replayed(schedule: Schedule) -> tuple[Programs, int]:
    """Per rank, ``schedule``'s programs lowered with a message between consecutive parts, and the most
    forwards one rank runs: what :func:`balanced_step` replays, alike whatever the parts cost (the search
    replays one schedule at several shares of forward and backward; the schedule is immutable)."""
    layout = schedule.layout
    edges = {(src, dst) for part in range(layout.num_parts - 1)
             for src, dst in zip(layout.stages_of_part(part), layout.stages_of_part(part + 1))}
    programs = layout.rank_programs(lower(schedule.programs, layout, edges))
    rank_work = max(sum(action.kind is ActionKind.F for action in program) for program in schedule.programs)
    return programs, rank_work


def family_step(kind: ScheduleKind, num_parts: int, num_microbatches: int, fwd_ms: float, bwd_ms: float,
                weight_grad_ms: float = 0.0, **options: Any) -> BalancedStep:
    """:func:`balanced_step` of ``kind``'s programs for ``num_parts`` parts and ``num_microbatches``, replayed
    at no more than two rounds of micro-batches (two per pipeline rank) and extended by the busiest rank's
    compute per further micro-batch: from the second round on, interleaved 1F1B and ZB-H1 on balanced
    parts never idle, so each micro-batch more adds exactly that (tests/unit/test_family_search.py checks
    the extension against full replays). GEMS-MASTER and WPipe, whose slots merge two stages' programs in
    the order a greedy replay starts them, are replayed whole (that order shifts with the count).

    >>> family_step(ScheduleKind.INTERLEAVED_1F1B, 8, 64, 1.0, 2.0, virtual_stages=2).step_ms  # (64 x 2 + 3) x 3
    393.0
    """
    ranks = num_parts // options.get("virtual_stages", 1)
    merged = kind in (ScheduleKind.GEMS_MASTER, ScheduleKind.WPIPE)  # programs merged by a greedy replay
    rounds = num_microbatches if merged else 2 * ranks
    replayed = min(num_microbatches, rounds)
    step = _family_replay(kind, num_parts, replayed, fwd_ms, bwd_ms, weight_grad_ms, tuple(sorted(options.items())))
    if replayed == num_microbatches:
        return step
    per_microbatch = step.rank_work // replayed  # parts a rank computes per micro-batch
    extra = num_microbatches - replayed
    return BalancedStep(step.step_ms + extra * per_microbatch * step.part_ms, step.part_ms,
                        step.rank_work + extra * per_microbatch)
