"""Validator: replays all ranks' programs without processes and rejects schedules that cannot run.

Semantics (the same as the runtime's): sends are asynchronous (``isend``) and never block; the
messages from one rank to another travel on a FIFO channel and are matched with receives by
order, as NCCL and gloo do; a receive blocks until its channel holds a message, and that message
must be exactly the one it expects (kind, micro-batch, source and destination stage).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from cost_models.errors import TesseraError
from planner.schedules.actions import Action, ActionKind, Programs, StageMap, matching_recv, matching_send
from planner.schedules.replay import replay, stuck_ranks

Cell = tuple[int, int]  # (rank, step)
_WINDOW = 8  # columns shown either side of the marked steps in a long grid


class ScheduleError(TesseraError, ValueError):
    """A schedule cannot run: the message gives the reason and the rank-by-step grid, failure marked."""

    def __init__(self, reason: str, programs: Programs = (), marks: Iterable[Cell] = ()) -> None:
        self.reason = reason
        self.marks = tuple(sorted(set(marks)))
        super().__init__(f"{reason}\n{format_grid(programs, self.marks)}" if programs else reason)


def format_grid(programs: Programs, marks: Iterable[Cell] = ()) -> str:
    """One row per rank, one column per step; marked cells read ``[2B5]!``.

    Long programs are cut to the columns around the marked steps.

    >>> print(format_grid(((Action.parse("0F0"),), (Action.parse("1F0"), Action.parse("1B0"))), [(1, 1)]))
    step    0    1
    rank 0  0F0
    rank 1  1F0  [1B0]!
    """
    marked = set(marks)
    width = max((len(program) for program in programs), default=0)
    first, last = _visible_columns(width, marked)
    rows = [["step"] + [str(step) for step in range(first, last)]]
    for rank, program in enumerate(programs):
        cells = [_cell(program, rank, step, marked) for step in range(first, last)]
        rows.append([f"rank {rank}"] + cells)
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(text.ljust(size) for text, size in zip(row, widths)).rstrip() for row in rows]
    if first > 0 or last < width:
        lines.append(f"(steps {first}..{last - 1} of 0..{width - 1} shown)")
    return "\n".join(lines)


def _visible_columns(width: int, marked: set[Cell]) -> tuple[int, int]:
    if width <= 4 * _WINDOW:
        return 0, width
    if not marked:
        return 0, 4 * _WINDOW
    steps = [step for _, step in marked]
    return max(0, min(steps) - _WINDOW), min(width, max(steps) + _WINDOW + 1)


def _cell(program: tuple[Action, ...], rank: int, step: int, marked: set[Cell]) -> str:
    if step >= len(program):
        return ""
    return f"[{program[step]}]!" if (rank, step) in marked else str(program[step])


def validate(programs: Programs, stage_map: StageMap, *, edges: Iterable[tuple[int, int]] | None = None) -> None:
    """Raise :class:`ScheduleError` unless the programs run to completion.

    Checks: every action on the rank its stage maps to; one F and one B per (stage, micro-batch);
    every B after its F; sends after the compute that produced them, receives before the compute
    that needs them; every send received in order and every receive sent; no deadlock; the
    all-reduce and optimizer step after all of a stage's backwards. With ``edges`` (as given to
    ``lower``), also that exactly the communication those edges need is present.

    >>> from planner.schedules.generate import one_f_one_b
    >>> from planner.schedules.lower import lower
    >>> s = one_f_one_b(3, 4)
    >>> validate(lower(s.programs, s.stage_map, {(0, 1), (1, 2)}, data_parallel=True), s.stage_map)
    """
    _check_placement(programs, stage_map)
    _check_once_per_stage(programs)
    num_microbatches = _check_coverage(programs, stage_map)
    _Replay(programs, stage_map, num_microbatches).run()
    if edges is not None:
        _check_edges(programs, stage_map, edges, num_microbatches)


def _check_placement(programs: Programs, stage_map: StageMap) -> None:
    if len(programs) != stage_map.num_ranks:
        raise ScheduleError(f"got {len(programs)} programs but the stage map {stage_map.rank_of_stage} "
                            f"has {stage_map.num_ranks} ranks", programs)
    for rank, program in enumerate(programs):
        for step, action in enumerate(program):
            stages = (action.stage,) if action.peer is None else (action.stage, action.peer)
            if any(stage >= stage_map.num_stages for stage in stages):
                raise ScheduleError(f"{action} names a stage outside 0..{stage_map.num_stages - 1}",
                                    programs, [(rank, step)])
            if stage_map.rank(action.stage) != rank:
                raise ScheduleError(f"{action} is in rank {rank}'s program but stage {action.stage} runs on "
                                    f"rank {stage_map.rank(action.stage)}", programs, [(rank, step)])


def _check_coverage(programs: Programs, stage_map: StageMap) -> int:
    """Exactly one F and one B per (stage, micro-batch 0..M-1); returns M."""
    where: dict[tuple[ActionKind, int, int], list[Cell]] = {}
    for rank, program in enumerate(programs):
        for step, action in enumerate(program):
            if action.kind in (ActionKind.F, ActionKind.B):
                assert action.microbatch is not None
                where.setdefault((action.kind, action.stage, action.microbatch), []).append((rank, step))
    num_microbatches = 1 + max((microbatch for _, _, microbatch in where), default=-1)
    for (kind, stage, microbatch), cells in sorted(where.items()):
        if len(cells) > 1:
            raise ScheduleError(f"duplicated {kind.value}: stage {stage} micro-batch {microbatch} appears "
                                f"{len(cells)} times", programs, cells)
    for stage in range(stage_map.num_stages):
        for microbatch in range(num_microbatches):
            for kind in (ActionKind.F, ActionKind.B):
                if (kind, stage, microbatch) not in where:
                    raise ScheduleError(f"missing {kind.value}: stage {stage} has no {kind.value} for "
                                        f"micro-batch {microbatch} (micro-batches 0..{num_microbatches - 1} "
                                        f"are scheduled elsewhere)", programs)
    return num_microbatches


def _check_once_per_stage(programs: Programs) -> None:
    """ALLREDUCE and OPTIMIZER_STEP run at most once per stage and step."""
    where: dict[tuple[ActionKind, int], list[Cell]] = {}
    for rank, program in enumerate(programs):
        for step, action in enumerate(program):
            if action.kind.is_per_stage:
                where.setdefault((action.kind, action.stage), []).append((rank, step))
    for (kind, stage), cells in sorted(where.items()):
        if len(cells) > 1:
            raise ScheduleError(f"duplicated {kind.value}: stage {stage} runs it {len(cells)} times",
                                programs, cells)


@dataclass
class _Replay:
    """State of one validation replay: what has run, and the messages in flight per channel."""

    programs: Programs
    stage_map: StageMap
    num_microbatches: int
    done: set[tuple[ActionKind, int, int]] = field(default_factory=set)
    backwards_done: Counter[int] = field(default_factory=Counter)
    channels: dict[tuple[int, int], deque[tuple[Action, Cell]]] = field(default_factory=dict)

    def run(self) -> None:
        positions = replay(self.programs, self._try_step)
        stuck = stuck_ranks(self.programs, positions)
        if stuck:
            self._explain_deadlock(stuck, positions)
        for queue in self.channels.values():
            if queue:
                send, cell = queue[0]
                raise ScheduleError(f"send without matching receive: {send} is never received by "
                                    f"stage {send.peer}", self.programs, [cell])

    def _fail(self, reason: str, *cells: Cell) -> None:
        raise ScheduleError(reason, self.programs, cells)

    def _try_step(self, rank: int, step: int, action: Action) -> bool:
        kind, stage, microbatch = action.kind, action.stage, action.microbatch
        if kind.is_recv:
            return self._receive(rank, step, action)
        if kind is ActionKind.B and (ActionKind.F, stage, microbatch) not in self.done:
            self._fail(f"B before its F: {action} runs before {stage}F{microbatch}", (rank, step))
        if kind.is_send:
            self._send(rank, step, action)
        if kind.is_per_stage and self.backwards_done[stage] < self.num_microbatches:
            self._fail(f"{action} runs before all {self.num_microbatches} backwards of stage {stage} "
                       f"(only {self.backwards_done[stage]} done)", (rank, step))
        if kind in (ActionKind.F, ActionKind.B):
            assert microbatch is not None
            self.done.add((kind, stage, microbatch))
            self.backwards_done[stage] += kind is ActionKind.B
        return True

    def _send(self, rank: int, step: int, send: Action) -> None:
        produced_by = ActionKind.F if send.kind is ActionKind.SEND_F else ActionKind.B
        if (produced_by, send.stage, send.microbatch) not in self.done:
            self._fail(f"{send} runs before the {produced_by.value} that produces it "
                       f"({send.stage}{produced_by.value}{send.microbatch})", (rank, step))
        assert send.peer is not None
        channel = (rank, self.stage_map.rank(send.peer))
        self.channels.setdefault(channel, deque()).append((send, (rank, step)))

    def _receive(self, rank: int, step: int, recv: Action) -> bool:
        consumer = ActionKind.F if recv.kind is ActionKind.RECV_F else ActionKind.B
        if (consumer, recv.stage, recv.microbatch) in self.done:
            self._fail(f"{recv} runs after the {consumer.value} that needs it", (rank, step))
        send = matching_send(recv)
        queue = self.channels.get((self.stage_map.rank(send.stage), rank))
        if not queue:
            return False
        head, cell = queue[0]
        if head != send:
            self._fail(f"out of order: {recv} expects {send} but the next message from rank {cell[0]} "
                       f"is {head} (meant for {matching_recv(head)}); sends to one rank must follow "
                       f"the order its receives take them", (rank, step), cell)
        queue.popleft()
        return True

    def _explain_deadlock(self, stuck: tuple[int, ...], positions: tuple[int, ...]) -> None:
        cells = [(rank, positions[rank]) for rank in stuck]
        for rank, step in cells:
            send = matching_send(self.programs[rank][step])
            src_rank = self.stage_map.rank(send.stage)
            if send not in self.programs[src_rank][positions[src_rank]:]:
                self._fail(f"receive without matching send: {self.programs[rank][step]} waits for {send}, "
                           f"which rank {src_rank} never sends", (rank, step))
        waits = ", ".join(f"rank {rank} at {self.programs[rank][step]}" for rank, step in cells)
        self._fail(f"deadlock: every unfinished rank waits on a receive ({waits})", *cells)


def _check_edges(programs: Programs, stage_map: StageMap, edges: Iterable[tuple[int, int]],
                 num_microbatches: int) -> None:
    expected: Counter[Action] = Counter()
    for src, dst in edges:
        if stage_map.same_rank(src, dst):
            continue
        for microbatch in range(num_microbatches):
            forward = Action(src, ActionKind.SEND_F, microbatch, peer=dst)
            backward = Action(dst, ActionKind.SEND_B, microbatch, peer=src)
            expected.update((forward, matching_recv(forward), backward, matching_recv(backward)))
    present = Counter(action for program in programs for action in program if action.kind.is_communication)
    for rank, program in enumerate(programs):
        for step, action in enumerate(program):
            if action.kind.is_communication and present[action] > expected[action]:
                raise ScheduleError(f"{action} is not needed by the edges given (or appears twice)",
                                    programs, [(rank, step)])
    missing = sorted(str(action) for action in expected if present[action] < expected[action])
    if missing:
        raise ScheduleError(f"communication missing for the edges given: {', '.join(missing[:8])}"
                            f"{' ...' if len(missing) > 8 else ''}", programs)
