"""Programs that run into the next step (WPipe): the forwards a step runs ahead, and those it inherits.

A step's program covers micro-batches ``0..M-1``; a schedule without a flush between steps may also
run forwards of the next step's micro-batch ``j``, named ``M + j``. Only forwards run ahead (a
backward never does), so ``M`` is one more than the highest micro-batch of any backward. Programs
are steady-state: the forwards a step runs ahead are the ones the previous step ran ahead for it,
so stage s's F of micro-batch ``j`` is *carried* (it ran in the previous step, and this step's
program has no ``F`` of ``j`` on s) exactly when the programs hold ``F`` of ``M + j`` on s.

The validator, the lowering and the simulator read programs through this one rule; the runtime runs
a step's ahead forwards alone before the first step (the prologue) and leaves them out of the last.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from planner.schedules.actions import Action, ActionKind

_BACKWARDS = frozenset({ActionKind.B, ActionKind.I, ActionKind.W})


@dataclass(frozen=True)
class Periods:
    """Which forwards a step's programs run ahead for the next step (and so inherit from the previous)."""

    num_microbatches: int
    ahead: frozenset[tuple[int, int]]  # (stage, j): F of the next step's micro-batch j runs in this step

    @classmethod
    def of(cls, programs: Iterable[Iterable[Action]]) -> Periods:
        """Read the rule off the programs (compute-only or lowered).

        >>> from planner.schedules.actions import parse_programs
        >>> Periods.of(parse_programs([["0B0", "0F1", "0B1", "0F2"]]))
        Periods(num_microbatches=2, ahead=frozenset({(0, 0)}))
        """
        actions = [action for program in programs for action in program]
        highest = highest_backward = -1  # micro-batches are >= 0
        for action in actions:
            if action.microbatch is not None:
                highest = max(highest, action.microbatch)
                if action.kind in _BACKWARDS:
                    highest_backward = max(highest_backward, action.microbatch)
        num_microbatches = 1 + (highest_backward if highest_backward >= 0 else highest)
        ahead = frozenset((action.stage, action.microbatch - num_microbatches) for action in actions
                          if action.kind is ActionKind.F and action.microbatch is not None
                          and action.microbatch >= num_microbatches)
        return cls(num_microbatches, ahead)

    @property
    def crosses_steps(self) -> bool:
        """Whether any forward runs ahead (a schedule without a flush between steps)."""
        return bool(self.ahead)

    def is_ahead(self, action: Action) -> bool:
        """An action on the next step's micro-batch (an ahead F or its communication)."""
        return action.microbatch is not None and action.microbatch >= self.num_microbatches

    def carried(self, stage: int, microbatch: int) -> bool:
        """Whether ``stage``'s F of this step's ``microbatch`` ran in the previous step."""
        return (stage, microbatch) in self.ahead

    def carried_on(self, stage: int) -> tuple[int, ...]:
        """This step's micro-batches whose F on ``stage`` ran in the previous step."""
        return tuple(sorted(j for s, j in self.ahead if s == stage))
