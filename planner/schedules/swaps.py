"""Swap actions: where a stage's swapped activations leave for the host and come back (a pass on programs).

For every stage that swaps (``OffloadSpec.swap``), in its slot's compute program:

* ``SWAP_OUT(s, m)`` right after ``F(s, m)``: the copies to the host that F started are awaited,
  so the device memory they used is free before the next compute;
* ``SWAP_IN(s, m)`` right before the backward that precedes ``B(s, m)`` on the same slot (right
  before ``B(s, m)`` when nothing precedes it): the copies back start one backward ahead, so
  they overlap that backward instead of stalling ``B(s, m)``.

Runs on compute-only programs, before planner.schedules.lower adds communication.
"""

from __future__ import annotations

from collections.abc import Collection

from planner.schedules.actions import Action, ActionKind, Program, Programs


def insert_swaps(compute_programs: Programs, swapping: Collection[int]) -> Programs:
    """``compute_programs`` with SWAP_OUT/SWAP_IN actions for the stages in ``swapping``.

    >>> from planner.schedules.generate import gpipe
    >>> [str(a) for a in insert_swaps(gpipe(1, 2).programs, {0})[0]]
    ['0F0', '0SWAP_OUT0', '0F1', '0SWAP_OUT1', '0SWAP_IN0', '0SWAP_IN1', '0B0', '0B1']
    """
    return tuple(_one_program(program, frozenset(swapping)) for program in compute_programs)


def _one_program(program: Program, swapping: frozenset[int]) -> Program:
    backwards = [index for index, action in enumerate(program) if action.kind.computes_input_grads]
    prefetch_at: dict[int, list[Action]] = {}
    for order, index in enumerate(backwards):
        action = program[index]
        if action.stage in swapping:
            at = backwards[order - 1] if order else index
            prefetch_at.setdefault(at, []).append(Action(action.stage, ActionKind.SWAP_IN, action.microbatch))
    lowered: list[Action] = []
    for index, action in enumerate(program):
        lowered.extend(prefetch_at.get(index, ()))
        lowered.append(action)
        if action.kind is ActionKind.F and action.stage in swapping:
            lowered.append(Action(action.stage, ActionKind.SWAP_OUT, action.microbatch))
    return tuple(lowered)
