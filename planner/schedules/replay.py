"""Advance every rank's program as far as it can go: the driver shared by validator and simulator."""

from __future__ import annotations

from collections.abc import Callable

from planner.schedules.actions import Action, Programs

StepFunction = Callable[[int, int, Action], bool]
"""``try_step(rank, step, action)``: run the action and return True, or return False while blocked."""


def replay(programs: Programs, try_step: StepFunction) -> tuple[int, ...]:
    """Run ranks round-robin, each until it blocks, until all finish or none can move.

    Returns each rank's position: equal to its program length when it finished, otherwise the
    step it is stuck at (a deadlock). Ranks interact only through messages and collectives (each
    waits for what it needs), so the order in which ranks are advanced does not change what each
    rank computes.

    >>> replay(((), ()), lambda rank, step, action: True)
    (0, 0)
    """
    positions = [0] * len(programs)
    progressed = True
    while progressed:
        progressed = False
        for rank, program in enumerate(programs):
            step, end = positions[rank], len(program)
            while step < end and try_step(rank, step, program[step]):
                step += 1
            if step != positions[rank]:
                positions[rank] = step
                progressed = True
    return tuple(positions)


def stuck_ranks(programs: Programs, positions: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks that did not reach the end of their program."""
    return tuple(rank for rank, program in enumerate(programs) if positions[rank] < len(program))
