"""Lowering: insert sends, receives, the gradient all-reduce and the optimizer step into compute programs.

Ordering rule (why lowered programs cannot deadlock or mismatch):

* Messages between two ranks travel on one FIFO channel per direction (as NCCL and gloo match
  point-to-point operations between a pair of ranks by posting order, not by tag), and sends
  are asynchronous (``isend``): a rank only ever blocks on a receive. Lowering works on slots
  (one program each); every rank of a slot runs its program, and the channels between the ranks
  of two slots carry the same sequence as the slots' channel, so the rule holds for every rank.
* Receives go immediately before the compute that consumes them: ``RECV_F`` before the F that
  needs the activation, ``RECV_B`` before the B (or the I of a split backward) that needs the
  gradient, several of them in ascending peer stage. A W needs no communication.
* Sends go after the compute that produces them, in the order the receiving rank consumes them
  on that channel: a send is emitted right after its F or B once every message the receiver
  takes earlier on the same channel has been emitted. With one stage per rank (GPipe, 1F1B)
  this is "immediately after the compute, by (micro-batch, peer stage)"; with several stages
  per slot and skip connections it may hold a send back until an earlier-consumed message is
  ready — which never delays the receiver, who has to wait for that earlier message anyway.
* Hence each channel's send order equals its receive order, and a receive waits only on
  computes the compute schedule already orders before it: if the compute schedule is free of
  cycles, so is the lowered one.
* Programs that run forwards ahead into the next step (planner/schedules/periods.py): a value goes
  in the step of the F that consumes it. An ahead F's output for a consumer that does not run ahead
  is sent in the next step, as a carried value, which a program makes available at its start (it
  was produced in the previous step), in the same consumption order.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from planner.plan.layout import Layout
from planner.schedules.actions import Action, ActionKind, Program, Programs, matching_send
from planner.schedules.periods import Periods

Edge = tuple[int, int]
Channel = tuple[int, int]  # (src slot, dst slot)

_COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.RECOMPUTE,
                            ActionKind.SWAP_OUT, ActionKind.SWAP_IN})


def lower(compute_programs: Programs, layout: Layout, edges: Iterable[Edge]) -> Programs:
    """Add communication to compute-only slot programs; ``edges`` are (src_stage, dst_stage) crossings.

    A stage whose part has several copies (data-parallel replicas, tiles, mirror copies) gets an
    ``ALLREDUCE`` before its ``OPTIMIZER_STEP``. Returns one program per slot.

    >>> from planner.schedules.generate import gpipe
    >>> schedule = gpipe(2, 1)
    >>> [[str(a) for a in p] for p in lower(schedule.programs, schedule.layout, {(0, 1)})]
    [['0F0', '0SEND_F0>1', '0RECV_B0<1', '0B0', '0OPTIMIZER_STEP'], ['1RECV_F0<0', '1F0', '1B0', '1SEND_B0>0', '1OPTIMIZER_STEP']]
    """
    _check_inputs(compute_programs, layout)
    crossings = _Crossings.of(_cross_slot_edges(edges, layout))
    with_receives = tuple(_insert_receives(program, crossings) for program in compute_programs)
    consumption = _consumption_order(with_receives, layout)
    sends = _Sends(crossings, Periods.of(compute_programs),
                   frozenset((a.stage, a.microbatch) for p in compute_programs for a in p if a.kind is ActionKind.F))
    return tuple(_insert_sends(slot, program, layout, sends, consumption)
                 + _epilogue(layout, slot)
                 for slot, program in enumerate(with_receives))


def _check_inputs(compute_programs: Programs, layout: Layout) -> None:
    if len(compute_programs) != layout.num_slots:
        raise ValueError(f"got {len(compute_programs)} programs but the layout has {layout.num_slots} slots")
    for slot, program in enumerate(compute_programs):
        for action in program:
            if action.kind not in _COMPUTE_KINDS:
                raise ValueError(f"lower() takes compute-only programs; slot {slot} already has {action}")


def _cross_slot_edges(edges: Iterable[Edge], layout: Layout) -> frozenset[Edge]:
    checked = set()
    for src, dst in edges:
        if not (0 <= src < dst < layout.num_stages):
            raise ValueError(f"edge ({src}, {dst}) must satisfy 0 <= src < dst < {layout.num_stages} "
                             f"(stages are numbered in topological order)")
        if layout.slot(src) != layout.slot(dst):
            checked.add((src, dst))
    return frozenset(checked)


@dataclass(frozen=True)
class _Crossings:
    """Per stage, its peers across the edges between stages on different slots, in ascending order (looked up
    for every action, so not searched for in the edges each time)."""

    sources: Mapping[int, tuple[int, ...]]  # dst stage -> the src stages whose activations it takes
    consumers: Mapping[int, tuple[int, ...]]  # src stage -> the dst stages that take its activations

    @classmethod
    def of(cls, cross_edges: frozenset[Edge]) -> _Crossings:
        sources: dict[int, list[int]] = {}
        consumers: dict[int, list[int]] = {}
        for src, dst in sorted(cross_edges):  # so each list comes out ascending
            consumers.setdefault(src, []).append(dst)
            sources.setdefault(dst, []).append(src)
        return cls({dst: tuple(srcs) for dst, srcs in sources.items()},
                   {src: tuple(dsts) for src, dsts in consumers.items()})


def _receives_before(action: Action, crossings: _Crossings) -> Program:
    if action.kind is ActionKind.F:
        return tuple(Action(action.stage, ActionKind.RECV_F, action.microbatch, peer=src)
                     for src in crossings.sources.get(action.stage, ()))
    if action.kind.computes_input_grads:
        return tuple(Action(action.stage, ActionKind.RECV_B, action.microbatch, peer=dst)
                     for dst in crossings.consumers.get(action.stage, ()))
    return ()


@dataclass(frozen=True)
class _Sends:
    """Which sends a compute action produces in this step, and which values a step inherits to send."""

    crossings: _Crossings
    periods: Periods
    forwards: frozenset[tuple[int, int | None]]  # (stage, micro-batch) of every F in the programs

    def after(self, action: Action) -> Program:
        """The sends the action's output makes in this step: an activation to each consumer whose F
        runs in this step, a gradient to each producer."""
        if action.kind is ActionKind.F:
            return tuple(Action(action.stage, ActionKind.SEND_F, action.microbatch, peer=dst)
                         for dst in self.crossings.consumers.get(action.stage, ())
                         if (dst, action.microbatch) in self.forwards)
        if action.kind.computes_input_grads:
            return tuple(Action(action.stage, ActionKind.SEND_B, action.microbatch, peer=src)
                         for src in self.crossings.sources.get(action.stage, ()))
        return ()

    def carried(self, slot: int, layout: Layout) -> Program:
        """The activations this slot's stages produced in the previous step (carried forwards) for
        consumers whose F runs in this step."""
        return tuple(Action(src, ActionKind.SEND_F, microbatch, peer=dst)
                     for src in layout.stages_on_slot(slot) for microbatch in self.periods.carried_on(src)
                     for dst in self.crossings.consumers.get(src, ())
                     if (dst, microbatch) in self.forwards)


def _insert_receives(program: Program, crossings: _Crossings) -> Program:
    return tuple(step for action in program for step in (*_receives_before(action, crossings), action))


def _consumption_order(programs: Programs, layout: Layout) -> dict[Channel, tuple[Action, ...]]:
    """Per channel, the sends in the order the receiving slot takes them."""
    order: dict[Channel, list[Action]] = {}
    for slot, program in enumerate(programs):
        for action in program:
            if action.kind.is_recv:
                send = matching_send(action)
                order.setdefault((layout.slot(send.stage), slot), []).append(send)
    return {channel: tuple(sends) for channel, sends in order.items()}


def _insert_sends(slot: int, program: Program, layout: Layout, sends: _Sends,
                  consumption: dict[Channel, tuple[Action, ...]]) -> Program:
    waiting = {channel: deque(sends) for channel, sends in sorted(consumption.items()) if channel[0] == slot}
    produced: list[Action] = list(sends.carried(slot, layout))  # in the order they were produced
    unsent = Counter(produced)  # of them, those not emitted yet (a count, not a search of the list)
    lowered: list[Action] = []
    for action in (None, *program):
        if action is not None:
            lowered.append(action)
            made = sends.after(action)
            produced.extend(made)
            unsent.update(made)
        for queue in waiting.values():
            while queue and unsent[queue[0]] > 0:
                lowered.append(queue.popleft())
                unsent[lowered[-1]] -= 1
    # Sends no receive takes (only from a broken compute schedule) go last so validate() names them: of each
    # send, the occurrences after the ones emitted.
    emitted = Counter(produced)
    emitted.subtract(unsent)
    leftover = []
    for send in produced:
        if emitted[send] > 0:
            emitted[send] -= 1
        else:
            leftover.append(send)
    return tuple(lowered) + tuple(leftover)


def _epilogue(layout: Layout, slot: int) -> Program:
    """Per stage of this slot, in part order: [ALLREDUCE], OPTIMIZER_STEP. One order of parts for every
    rank, so ranks that share two all-reduce groups (a GEMS mirror pair) enter them alike."""
    ordered = sorted(layout.stages_on_slot(slot), key=lambda stage: (layout.part(stage), stage))
    return tuple(Action(stage, kind) for stage in ordered for kind in _per_step_kinds(layout, stage))


def _per_step_kinds(layout: Layout, stage: int) -> tuple[ActionKind, ...]:
    copies = len(layout.part_ranks(layout.part(stage)))
    return (ActionKind.ALLREDUCE, ActionKind.OPTIMIZER_STEP) if copies > 1 else (ActionKind.OPTIMIZER_STEP,)
