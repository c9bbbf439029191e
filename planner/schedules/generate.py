"""Schedule generators: per-slot compute programs (F and B only) and the layout, for each schedule kind."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from planner.plan.kinds import ScheduleKind
from planner.plan.layout import Layout
from planner.schedules.actions import Action, ActionKind, Program, Programs
from planner.schedules.periods import Periods


@dataclass(frozen=True)
class Schedule:
    """A generator's output: compute-only programs per slot and the layout that places every stage."""

    kind: ScheduleKind
    num_microbatches: int
    layout: Layout
    programs: Programs  # per slot

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @functools.cached_property
    def held(self) -> HeldCounts:
        """What the programs hold per stage (read by :func:`max_in_flight` and the functions after it),
        counted once: the search asks every function of every configuration's schedule."""
        return HeldCounts.of(self)


@dataclass(frozen=True)
class HeldCounts:
    """Per stage, the micro-batch counts a schedule's programs hold at their peaks."""

    in_flight: tuple[int, ...]  # the most between their F and their B (or W), from those carried in
    accumulating: tuple[int, ...]  # the same, when a backward that adds into the stage's gradients starts
    waiting: tuple[int, ...]  # the most whose split backward's I ran but whose W waits
    waiting_at_start: tuple[int, ...]  # the same, at the start of an F or an I

    @classmethod
    def of(cls, schedule: Schedule) -> HeldCounts:
        """One pass over the programs: a stage's actions are all in its slot's program, in order."""
        periods = Periods.of(schedule.programs)
        stages = range(schedule.num_stages)
        held = [len(periods.carried_on(stage)) for stage in stages]  # between F and B (or W)
        in_flight, accumulating, started = list(held), [0 for _ in stages], [False for _ in stages]
        open_, waiting, at_start = ([0 for _ in stages] for _ in range(3))  # between I and W
        forward, input_grad, weight_grad, backward = ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B
        for program in schedule.programs:
            for action in program:
                kind, stage = action.kind, action.stage
                if (kind is forward or kind is input_grad) and open_[stage] > at_start[stage]:
                    at_start[stage] = open_[stage]
                if kind is forward:
                    held[stage] += 1
                    in_flight[stage] = max(in_flight[stage], held[stage])
                elif kind is backward or kind is weight_grad:  # ends the micro-batch's backward
                    if started[stage] and held[stage] > accumulating[stage]:
                        accumulating[stage] = held[stage]
                    started[stage] = True
                    held[stage] -= 1
                if kind is input_grad:
                    open_[stage] += 1
                    waiting[stage] = max(waiting[stage], open_[stage])
                elif kind is weight_grad:
                    open_[stage] -= 1
        return cls(tuple(in_flight), tuple(accumulating), tuple(waiting), tuple(at_start))


ScheduleGenerator = Callable[..., Schedule]
"""``generator(num_stages, num_microbatches, *, data_parallel, **options) -> Schedule``; ``num_stages``
counts the model's parts; later kinds add keyword options."""


def gpipe(num_stages: int, num_microbatches: int, *, data_parallel: int = 1,
          tiles: Sequence[int] | None = None) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (in micro-batch order).

    ``tiles[s]`` ranks split stage s spatially (default one each); they all run its program.

    >>> [str(a) for a in gpipe(2, 2).programs[1]]
    ['1F0', '1F1', '1B0', '1B1']
    """
    _check_sizes(num_stages, num_microbatches)
    programs = tuple(_forwards(stage, range(num_microbatches)) + _backwards(stage, range(num_microbatches))
                     for stage in range(num_stages))
    layout = Layout.pipeline(num_stages, data_parallel, tiles)
    return Schedule(ScheduleKind.GPIPE, num_microbatches, layout, programs)


def one_f_one_b(num_stages: int, num_microbatches: int, *, data_parallel: int = 1,
                tiles: Sequence[int] | None = None) -> Schedule:
    """Non-interleaved 1F1B: ``min(M, S - s)`` warm-up forwards, then B/F pairs, then the remaining Bs.

    ``tiles[s]`` ranks split stage s spatially (default one each); they all run its program.

    >>> [str(a) for a in one_f_one_b(2, 3).programs[0]]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    _check_sizes(num_stages, num_microbatches)
    programs = tuple(_one_f_one_b_stage(stage, num_stages, num_microbatches) for stage in range(num_stages))
    return Schedule(ScheduleKind.ONE_F_ONE_B, num_microbatches, Layout.pipeline(num_stages, data_parallel, tiles),
                    programs)


def _one_f_one_b_stage(stage: int, num_stages: int, num_microbatches: int) -> Program:
    warmup = min(num_microbatches, num_stages - stage)
    program = list(_forwards(stage, range(warmup)))
    for microbatch in range(num_microbatches - warmup):
        program.append(_compute(stage, ActionKind.B, microbatch))
        program.append(_compute(stage, ActionKind.F, warmup + microbatch))
    program.extend(_backwards(stage, range(num_microbatches - warmup, num_microbatches)))
    return tuple(program)


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, *, data_parallel: int = 1,
                            virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: ``num_stages`` = ranks x ``virtual_stages``, stage s on slot s % ranks.

    Each slot runs its k-th forward on virtual stage ``(k // ranks) % v`` and micro-batch
    ``(k // (ranks * v)) * ranks + k % ranks`` (backwards visit the virtual stages in reverse),
    ``2 (ranks - 1 - slot) + (v - 1) ranks`` forwards of warm-up, then F/B pairs, then the rest of
    the Bs. The micro-batch count must be a multiple of the rank count.

    >>> [str(a) for a in interleaved_one_f_one_b(4, 2).programs[1]]
    ['1F0', '1F1', '3F0', '3F1', '3B0', '3B1', '1B0', '1B1']
    """
    _check_sizes(num_stages, num_microbatches)
    ranks = _interleaved_ranks(num_stages, num_microbatches, virtual_stages)
    programs = tuple(_interleaved_slot(slot, ranks, virtual_stages, num_microbatches) for slot in range(ranks))
    layout = Layout.replicated(tuple(stage % ranks for stage in range(num_stages)), data_parallel)
    return Schedule(ScheduleKind.INTERLEAVED_1F1B, num_microbatches, layout, programs)


def _interleaved_ranks(num_stages: int, num_microbatches: int, virtual_stages: int) -> int:
    """The rank count (stages per replica / v), or ValueError naming the counts that work."""
    if virtual_stages < 1 or num_stages % virtual_stages:
        raise ValueError(f"interleaved-1f1b with {virtual_stages} virtual stages per rank needs a stage count "
                         f"that is a multiple of {virtual_stages}, got {num_stages}; valid: "
                         f"{', '.join(str(virtual_stages * k) for k in range(1, 4))}, ...")
    ranks = num_stages // virtual_stages
    if num_microbatches % ranks:
        raise ValueError(f"interleaved-1f1b on {ranks} ranks needs a micro-batch count that is a multiple of "
                         f"{ranks}, got {num_microbatches}; valid: "
                         f"{', '.join(str(ranks * k) for k in range(1, 4))}, ...")
    return ranks


def _interleaved_slot(slot: int, ranks: int, virtual_stages: int, num_microbatches: int) -> Program:
    total = num_microbatches * virtual_stages
    warmup = total if num_microbatches == ranks else min(
        total, 2 * (ranks - 1 - slot) + (virtual_stages - 1) * ranks)

    def action(kind: ActionKind, k: int) -> Action:
        chunk = (k % (ranks * virtual_stages)) // ranks
        if kind is ActionKind.B:
            chunk = virtual_stages - 1 - chunk
        return _compute(chunk * ranks + slot, kind, (k // (ranks * virtual_stages)) * ranks + k % ranks)

    program = [action(ActionKind.F, k) for k in range(warmup)]
    for k in range(total - warmup):
        program += [action(ActionKind.F, warmup + k), action(ActionKind.B, k)]
    program += [action(ActionKind.B, k) for k in range(total - warmup, total)]
    return tuple(program)


def zb_h1(num_stages: int, num_microbatches: int, *, data_parallel: int = 1,
          tiles: Sequence[int] | None = None) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B with each backward split into its input-gradient half I
    (which the previous stage waits for) and its weight-gradient half W (which nobody waits for).

    Stage s warms up with ``min(M, S - s)`` forwards like 1F1B, then runs I of the oldest micro-batch,
    the W that leaves at most s of them pending, and the next F; its last s Ws fill the drain, where
    1F1B waits. Every stage holds at most S micro-batches (1F1B's peak, on stage 0). ``tiles[s]`` ranks split
    stage s spatially (default one each); they all run its program.

    >>> [str(a) for a in zb_h1(2, 3).programs[1]]
    ['1F0', '1I0', '1F1', '1I1', '1W0', '1F2', '1I2', '1W1', '1W2']
    """
    _check_sizes(num_stages, num_microbatches)
    programs = tuple(_zb_h1_stage(stage, num_stages, num_microbatches) for stage in range(num_stages))
    return Schedule(ScheduleKind.ZB_H1, num_microbatches, Layout.pipeline(num_stages, data_parallel, tiles),
                    programs)


def _zb_h1_stage(stage: int, num_stages: int, num_microbatches: int) -> Program:
    warmup = min(num_microbatches, num_stages - stage)
    program = list(_forwards(stage, range(warmup)))
    for microbatch in range(num_microbatches):
        program.append(_compute(stage, ActionKind.I, microbatch))
        if microbatch >= stage:
            program.append(_compute(stage, ActionKind.W, microbatch - stage))
        if warmup + microbatch < num_microbatches:
            program.append(_compute(stage, ActionKind.F, warmup + microbatch))
    first_pending = max(0, num_microbatches - stage)
    program.extend(_compute(stage, ActionKind.W, microbatch)
                   for microbatch in range(first_pending, num_microbatches))
    return tuple(program)


def gems_master(num_stages: int, num_microbatches: int, *, data_parallel: int = 1) -> Schedule:
    """GEMS-MASTER (Jain et al. 2020): two copies of the ``num_stages``-part model in opposite directions
    (``Layout.mirrored``: slot k runs part k of copy A and part S-1-k of copy B), so one copy's forwards
    fill the other's bubble; the two copies of a part sum their gradients before the step. The part
    count must be even (so that no slot holds both copies of one part).

    Copy A runs micro-batches 0..M/2-1 and copy B the rest, each in 1F1B order; each slot interleaves
    its two stages' actions in the order a replay with unit costs (F 1, B 2) starts them. The
    micro-batch count must be even.

    >>> [str(a) for a in gems_master(2, 2).programs[0]]
    ['0F0', '3F1', '3B1', '0B0']
    """
    _check_sizes(num_stages, num_microbatches)
    if num_stages % 2:  # the middle slot would hold both copies of one part
        raise ValueError(f"gems-master pairs slot k with slot S-1-k and needs an even number of parts, got "
                         f"{num_stages}; valid: 2, 4, 6, ...")
    if num_microbatches % 2:
        raise ValueError(f"gems-master splits the micro-batches between its 2 model copies and needs an even "
                         f"count, got {num_microbatches}; valid: 2, 4, 6, ...")
    layout = Layout.mirrored(num_stages, data_parallel)
    half = num_microbatches // 2
    streams = {layout.stage_of_copy(part, copy): tuple(
        _compute(layout.stage_of_copy(part, copy), action.kind, copy * half + action.microbatch)
        for action in _one_f_one_b_stage(part, num_stages, half) if action.microbatch is not None)
        for part in range(num_stages) for copy in range(2)}
    inputs = _copy_inputs(layout)

    def ready(action: Action, finished: Mapping[tuple[ActionKind, int, int | None], int]) -> int | None:
        """When the action's input is there: the previous part's F, or the next part's B, of its own copy."""
        source = inputs[action.kind, action.stage]
        return 0 if source is None else finished.get((action.kind, source, action.microbatch))

    return Schedule(ScheduleKind.GEMS_MASTER, num_microbatches, layout, _merged(layout, streams, ready))


def wpipe(num_stages: int, num_microbatches: int, *, data_parallel: int = 1) -> Schedule:
    """WPipe (Yang et al. 2022): the ``num_stages`` parts in two groups on ``ranks = num_stages / 2`` slots
    (part s on slot s % ranks, as interleaved 1F1B with 2 virtual stages); the first group never
    flushes. Its stage s keeps ``a_s = min(M, num_stages - s)`` micro-batches in flight across the step
    boundary: its program alternates the backward of micro-batch j with the forward of micro-batch
    j + a_s, and those forwards reaching past M are the next step's (named ``M + j``,
    planner/schedules/periods.py), run ahead to fill the drain where 1F1B idles. The second group runs
    1F1B and flushes every step, so its weights are never stale; the first group's forwards of a step
    run on its weights from before the previous step's update (the runtime stashes that version), the
    one-step delay WPipe trades for the bubble. Each slot merges its two stages' actions in the
    order a replay with unit costs (F 1, B 2) starts them.

    >>> [str(a) for a in wpipe(2, 2).programs[0]]
    ['1F0', '1B0', '0B0', '1F1', '1B1', '0F2', '0B1', '0F3']
    """
    _check_sizes(num_stages, num_microbatches)
    if num_stages % 2:
        raise ValueError(f"wpipe splits the parts into two groups of equal size and needs an even number of "
                         f"parts, got {num_stages}; valid: 2, 4, 6, ...")
    ranks = num_stages // 2
    layout = Layout.replicated(tuple(stage % ranks for stage in range(num_stages)), data_parallel)
    ahead = tuple(min(num_microbatches, num_stages - stage) for stage in range(ranks))
    streams = {stage: tuple(action for j in range(num_microbatches) for action in (
        _compute(stage, ActionKind.B, j), _compute(stage, ActionKind.F, j + ahead[stage])))
        for stage in range(ranks)}
    streams.update({stage: _one_f_one_b_stage(stage, num_stages, num_microbatches)
                    for stage in range(ranks, num_stages)})

    def ready(action: Action, finished: Mapping[tuple[ActionKind, int, int | None], int]) -> int | None:
        assert action.microbatch is not None
        neighbour = action.stage - 1 if action.kind is ActionKind.F else action.stage + 1
        if not 0 <= neighbour < num_stages:
            return 0
        if action.kind is ActionKind.F and neighbour < ranks and action.microbatch < ahead[neighbour]:
            return 0  # the neighbour's forward ran in the previous step
        return finished.get((action.kind, neighbour, action.microbatch))

    return Schedule(ScheduleKind.WPIPE, num_microbatches, layout, _merged(layout, streams, ready))


STASHED_WEIGHT_VERSIONS = 2
"""Copies of a stale part's weights held besides the ones its optimizer steps: the version this step's
micro-batches read and the one the next step's ahead forwards read (runtime/stale.py makes these)."""


ReadyAt = Callable[[Action, Mapping[tuple[ActionKind, int, "int | None"], int]], "int | None"]
"""When an action's input is there, given the finish times of the actions run so far (None: not yet)."""


def _merged(layout: Layout, streams: Mapping[int, Program], ready_at: ReadyAt) -> Programs:
    """Each slot's stage programs merged in the order a replay with unit costs (F 1, B 2) starts them:
    repeatedly the action that can start earliest runs next (ties: this step's work before a forward run
    ahead for the next, then a B before an F, as 1F1B frees activations first; then the lower slot and
    stage). That replay is an execution, so the merged programs cannot deadlock."""
    periods = Periods.of(streams.values())
    duration = {ActionKind.F: 1, ActionKind.B: 2}
    finished: dict[tuple[ActionKind, int, int | None], int] = {}
    position = dict.fromkeys(streams, 0)
    slot_of = {stage: layout.slot(stage) for stage in streams}
    ready: dict[int, int] = {}  # per stage, when its next action's input is there, once known: what it waits
    # for has finished, and a finish time never changes, so it is asked again only once the stage moves on
    free = [0] * layout.num_slots
    programs: list[list[Action]] = [[] for _ in range(layout.num_slots)]
    live = [stage for stage, stream in streams.items() if stream]
    while live:
        earliest = None
        for stage in live:
            action = streams[stage][position[stage]]
            if stage not in ready:
                at = ready_at(action, finished)
                if at is None:
                    continue
                ready[stage] = at
            candidate = (max(free[slot_of[stage]], ready[stage]), periods.is_ahead(action),
                         action.kind is ActionKind.F, slot_of[stage], stage)
            if earliest is None or candidate < earliest:
                earliest = candidate
        if earliest is None:
            raise ValueError(f"no stage's next action can start; merged so far: {programs}")
        start, *_, slot, stage = earliest
        action = streams[stage][position[stage]]
        position[stage] += 1
        del ready[stage]
        if position[stage] == len(streams[stage]):
            live.remove(stage)
        free[slot] = finished[action.kind, stage, action.microbatch] = start + duration[action.kind]
        programs[slot].append(action)
    return tuple(tuple(program) for program in programs)


def _copy_inputs(layout: Layout) -> dict[tuple[ActionKind, int], int | None]:
    """Per (F or B, stage), the stage of its model copy whose F or B makes its input: the previous part's
    stage for an F, the next part's for a B (None at the copy's ends, whose inputs are always there)."""
    inputs: dict[tuple[ActionKind, int], int | None] = {}
    for stage in range(layout.num_stages):
        part, copy = layout.part(stage), layout.copy(stage)
        for kind, neighbour in ((ActionKind.F, part - 1), (ActionKind.B, part + 1)):
            inside = 0 <= neighbour < layout.num_parts
            inputs[kind, stage] = layout.stage_of_copy(neighbour, copy) if inside else None
    return inputs


@functools.lru_cache(maxsize=1 << 16)
def _compute(stage: int, kind: ActionKind, microbatch: int) -> Action:
    """The compute action (stage, kind, micro-batch), built once and shared by every program that runs it: a
    search generates the programs of a thousand configurations, which name the same few thousand actions
    (building an action checks it, which costs more than the look-up), and programs that share their
    actions compare fast. Actions are immutable, so sharing them changes nothing else."""
    return Action(stage, kind, microbatch)


def _forwards(stage: int, microbatches: range) -> Program:
    return tuple(_compute(stage, ActionKind.F, microbatch) for microbatch in microbatches)


def _backwards(stage: int, microbatches: range) -> Program:
    return tuple(_compute(stage, ActionKind.B, microbatch) for microbatch in microbatches)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"a schedule needs num_stages >= 1 and num_microbatches >= 1, "
                         f"got num_stages={num_stages}, num_microbatches={num_microbatches}")


GENERATORS: Mapping[ScheduleKind, ScheduleGenerator] = MappingProxyType({
    ScheduleKind.GPIPE: gpipe,
    ScheduleKind.ONE_F_ONE_B: one_f_one_b,
    ScheduleKind.INTERLEAVED_1F1B: interleaved_one_f_one_b,
    ScheduleKind.ZB_H1: zb_h1,
    ScheduleKind.GEMS_MASTER: gems_master,
    ScheduleKind.WPIPE: wpipe,
})
"""Schedule kind (the plan's ``schedule.kind``) -> generator. A new kind is a new entry here."""


def generate(kind: str | ScheduleKind, num_stages: int, num_microbatches: int, *, data_parallel: int = 1,
             **options: Any) -> Schedule:
    """Look up the generator for ``kind`` and run it.

    >>> generate("1f1b", 4, 8, data_parallel=2).layout.world_size
    8
    """
    return GENERATORS[ScheduleKind.parse(kind)](num_stages, num_microbatches, data_parallel=data_parallel,
                                                **options)


def max_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches between their F and their B at once (running max of F - B,
    from the micro-batches carried into the step).

    >>> max_in_flight(one_f_one_b(3, 8)), max_in_flight(wpipe(4, 4))
    ((3, 2, 1), (4, 3, 2, 1))
    """
    return schedule.held.in_flight


def accumulating_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches between their F and their B when a backward that adds into the
    stage's gradients starts (a B or W after the stage's first of the step, which makes them): the weight
    gradients it computes are held until added in. 0 where the stage has one backward a step.

    >>> accumulating_in_flight(gpipe(2, 4)), accumulating_in_flight(one_f_one_b(3, 8))
    ((3, 3), (3, 2, 1))
    """
    return schedule.held.accumulating


def weight_grads_waiting(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage, the most micro-batches whose input gradient ran but whose weight gradient waits (a split
    backward's I then W: what I keeps for W is held between them): at once at any moment, and at the start
    of an F or an I (the moments that may hold the stage's largest transient, the loss's). 0 where no
    backward is split.

    >>> weight_grads_waiting(zb_h1(3, 6)), weight_grads_waiting(one_f_one_b(2, 4))
    (((1, 2, 3), (0, 1, 2)), ((0, 0), (0, 0)))
    """
    return schedule.held.waiting, schedule.held.waiting_at_start


def swapped_resident(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose swapped activations are back on the device at once when the
    stage swaps (planner/schedules/swaps.py): the one in its backward, the one prefetched for the next,
    and those whose input gradient ran but whose weight gradient waits (a split backward keeps what it
    saved until its W).

    >>> swapped_resident(one_f_one_b(2, 4)), swapped_resident(zb_h1(3, 6))
    ((2, 2), (2, 3, 4))
    """
    return tuple(2 + max(0, waiting - 1) for waiting in weight_grads_waiting(schedule)[0])


def in_flight_profiles(schedule: Schedule) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per slot, the in-flight counts that can be its activation peak: one vector per candidate moment,
    holding per stage of the slot (in ``layout.stages_on_slot`` order) the micro-batches between
    their F and their B (those carried into the step count from its start), only vectors that no
    other one covers.

    A rank's peak activation bytes is the largest ``sum(held * activation_bytes)`` over its slot's
    vectors, whatever the stages' sizes (one memory row per vector keeps that linear).

    >>> in_flight_profiles(interleaved_one_f_one_b(4, 2))
    (((2, 2),), ((2, 2),))
    """
    periods = Periods.of(schedule.programs)
    return tuple(_slot_profiles(program, schedule.layout.stages_on_slot(slot), periods)
                 for slot, program in enumerate(schedule.programs))


def _slot_profiles(program: Program, stages: tuple[int, ...], periods: Periods) -> tuple[tuple[int, ...], ...]:
    held = {stage: len(periods.carried_on(stage)) for stage in stages}
    moments: list[tuple[int, ...]] = [tuple(held.values())]
    for action in program:
        if action.kind is ActionKind.F:
            held[action.stage] += 1
            moments.append(tuple(held.values()))
        elif action.kind.ends_backward:
            held[action.stage] -= 1
    return tuple(sorted({vector for vector in moments if not any(
        other != vector and all(o >= v for o, v in zip(other, vector)) for other in moments)}))
