"""Validator: replays all ranks' programs without processes and rejects schedules that cannot run.

Semantics (the same as the runtime's): sends are asynchronous (``isend``) and never block; the
messages from one rank to another travel on a FIFO channel and are matched with receives by
order, as NCCL and gloo do; a receive blocks until its channel holds a message, and that message
must be exactly the one it expects (kind, micro-batch, source and destination stage). Programs
are per rank of the whole job; the layout says which stages each rank runs and which ranks a
message between two stages travels between (every tile of the sender to every tile of the
receiver, within one replica).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from cost_models.errors import TesseraError
from planner.plan.layout import Layout
from planner.schedules.actions import Action, ActionKind, Programs, matching_recv, matching_send
from planner.schedules.periods import Periods
from planner.schedules.replay import replay, stuck_ranks

Cell = tuple[int, int]  # (rank, step)
_COMPUTE = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
_NEEDS = {ActionKind.B: ActionKind.F, ActionKind.I: ActionKind.F, ActionKind.W: ActionKind.I}  # runs after
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


def validate(programs: Programs, layout: Layout, *, edges: Iterable[tuple[int, int]] | None = None) -> None:
    """Raise :class:`ScheduleError` unless the programs (one per rank) run to completion.

    Checks: every action on a rank that runs its stage; every micro-batch through every part once
    (on one model copy's stage), with one F and one B (or one I and one W) on every rank of that stage; every B or I after its F, every W after its I; sends after the compute that produced them,
    receives before the compute that needs them; every send received in order and every receive
    sent; no deadlock; the all-reduce and optimizer step after all of a stage's backwards. Programs
    that run forwards ahead into the next step are read by planner/schedules/periods.py's rule (a
    carried F counts as run before the step starts; an ahead F needs no backward in it). With
    ``edges`` (as given to ``lower``), also that exactly the communication those edges need is present.

    >>> from planner.schedules.generate import one_f_one_b
    >>> from planner.schedules.lower import lower
    >>> s = one_f_one_b(3, 4, data_parallel=2)
    >>> validate(s.layout.rank_programs(lower(s.programs, s.layout, {(0, 1), (1, 2)})), s.layout)
    """
    _check_placement(programs, layout)
    _check_once_per_stage(programs)
    periods = Periods.of(programs)
    microbatches = _check_coverage(programs, layout, periods)
    _Replay(programs, layout, {stage: len(runs) for stage, runs in microbatches.items()}, periods).run()
    if edges is not None:
        _check_edges(programs, layout, edges, microbatches)


def _check_placement(programs: Programs, layout: Layout) -> None:
    if len(programs) != layout.world_size:
        raise ScheduleError(f"got {len(programs)} programs but the layout has {layout.world_size} ranks",
                            programs)
    for rank, program in enumerate(programs):
        mine = layout.stages_of_rank(rank)
        for step, action in enumerate(program):
            stages = (action.stage,) if action.peer is None else (action.stage, action.peer)
            if any(stage >= layout.num_stages for stage in stages):
                raise ScheduleError(f"{action} names a stage outside 0..{layout.num_stages - 1}",
                                    programs, [(rank, step)])
            if action.stage not in mine:
                raise ScheduleError(f"{action} is in rank {rank}'s program but stage {action.stage} runs on "
                                    f"ranks {_ranks_text(layout, action.stage)}", programs, [(rank, step)])


def _ranks_text(layout: Layout, stage: int) -> str:
    return ", ".join(str(rank) for replica in range(layout.data_parallel)
                     for rank in layout.ranks_of(stage, replica))


def _check_coverage(programs: Programs, layout: Layout, periods: Periods) -> dict[int, tuple[int, ...]]:
    """Every micro-batch 0..M-1 runs every part once, on one model copy's stage; a stage runs the same
    micro-batches on all its ranks, each with one F (or a carried one) and one backward (a B, or its
    halves I and W); returns each stage's micro-batches."""
    where: dict[tuple[int, ActionKind, int, int], list[Cell]] = {}
    runs: dict[tuple[int, int], set[int]] = {}  # (rank, stage) -> its micro-batches
    num_microbatches = periods.num_microbatches
    for rank, program in enumerate(programs):
        for step, action in enumerate(program):
            if action.kind in _COMPUTE:
                assert action.microbatch is not None
                where.setdefault((rank, action.kind, action.stage, action.microbatch), []).append((rank, step))
                if not periods.is_ahead(action):
                    runs.setdefault((rank, action.stage), set()).add(action.microbatch)
                elif action.microbatch >= 2 * num_microbatches:
                    raise ScheduleError(f"{action} runs more than one step ahead: the next step's micro-batch j "
                                        f"is {num_microbatches} + j, j < {num_microbatches}", programs, [(rank, step)])
                elif (rank, ActionKind.F, action.stage, action.microbatch - num_microbatches) in where:
                    raise ScheduleError(f"{action} runs ahead for the next step, so micro-batch "
                                        f"{action.microbatch - num_microbatches}'s F on stage {action.stage} ran in "
                                        f"the previous step; it cannot run again in this one", programs,
                                        [(rank, step), *where[rank, ActionKind.F, action.stage,
                                                                action.microbatch - num_microbatches]])
    for (rank, kind, stage, microbatch), cells in sorted(where.items()):
        if len(cells) > 1:
            raise ScheduleError(f"duplicated {kind.value}: stage {stage} micro-batch {microbatch} appears "
                                f"{len(cells)} times on rank {rank}", programs, cells)
    stage_runs: dict[int, tuple[int, set[int]]] = {}  # stage -> (its first rank, its micro-batches)
    for rank in range(len(programs)):
        for stage in layout.stages_of_rank(rank):
            mine = runs.get((rank, stage), set())
            first, theirs = stage_runs.setdefault(stage, (rank, mine))
            if mine != theirs:
                raise ScheduleError(f"stage {stage} runs micro-batches {sorted(mine)} on rank {rank} but "
                                    f"{sorted(theirs)} on rank {first}; every rank of a stage runs the same",
                                    programs)
            for microbatch in sorted(mine):
                _check_one_backward(programs, where, rank, stage, microbatch, periods.carried(stage, microbatch))
    for part in range(layout.num_parts):
        for microbatch in range(num_microbatches):
            stages = [stage for stage in layout.stages_of_part(part) if microbatch in stage_runs[stage][1]]
            if len(stages) != 1:
                raise ScheduleError(f"micro-batch {microbatch} runs part {part} on stages {stages}; every "
                                    f"micro-batch 0..{num_microbatches - 1} runs every part once, on one of "
                                    f"its stages {list(layout.stages_of_part(part))}", programs)
    return {stage: tuple(sorted(runs)) for stage, (_, runs) in stage_runs.items()}


def _check_one_backward(programs: Programs, where: dict[tuple[int, ActionKind, int, int], list[Cell]],
                        rank: int, stage: int, microbatch: int, carried: bool) -> None:
    """One F (unless it was carried from the previous step) and either a B or both I and W for the
    micro-batch on that rank."""
    split = {kind for kind in (ActionKind.I, ActionKind.W) if (rank, kind, stage, microbatch) in where}
    if split and (rank, ActionKind.B, stage, microbatch) in where:
        raise ScheduleError(f"stage {stage} micro-batch {microbatch} has a B and its halves "
                            f"{'/'.join(sorted(k.value for k in split))} on rank {rank}; give either B or "
                            f"both I and W", programs, where[rank, ActionKind.B, stage, microbatch])
    for kind in (ActionKind.F, ActionKind.I, ActionKind.W) if split else (ActionKind.F, ActionKind.B):
        if (rank, kind, stage, microbatch) not in where and not (kind is ActionKind.F and carried):
            raise ScheduleError(f"missing {kind.value}: rank {rank} runs stage {stage} but has no "
                                f"{kind.value} for micro-batch {microbatch}", programs)


def _check_once_per_stage(programs: Programs) -> None:
    """ALLREDUCE and OPTIMIZER_STEP run at most once per stage and step on each rank."""
    where: dict[tuple[int, ActionKind, int], list[Cell]] = {}
    for rank, program in enumerate(programs):
        for step, action in enumerate(program):
            if action.kind.is_per_stage:
                where.setdefault((rank, action.kind, action.stage), []).append((rank, step))
    for (rank, kind, stage), cells in sorted(where.items()):
        if len(cells) > 1:
            raise ScheduleError(f"duplicated {kind.value}: stage {stage} runs it {len(cells)} times on "
                                f"rank {rank}", programs, cells)


@dataclass
class _Replay:
    """State of one validation replay: what has run on each rank, and the messages in flight per channel."""

    programs: Programs
    layout: Layout
    stage_microbatches: dict[int, int]  # stage -> how many micro-batches it runs
    periods: Periods
    done: set[tuple[int, ActionKind, int, int]] = field(default_factory=set)  # rank, kind, stage, micro
    backwards_done: Counter[tuple[int, int]] = field(default_factory=Counter)  # (rank, stage)
    channels: dict[tuple[int, int], deque[tuple[Action, Cell]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.done.update((rank, ActionKind.F, stage, microbatch) for rank in range(len(self.programs))
                         for stage in self.layout.stages_of_rank(rank) for microbatch in self.periods.carried_on(stage))

    def run(self) -> None:
        positions = replay(self.programs, self._try_step)
        stuck = stuck_ranks(self.programs, positions)
        if stuck:
            self._explain_deadlock(stuck, positions)
        for (src, dst), queue in self.channels.items():
            if queue:
                send, cell = queue[0]
                raise ScheduleError(f"send without matching receive: {send} on rank {src} is never received "
                                    f"by stage {send.peer} on rank {dst}", self.programs, [cell])

    def _fail(self, reason: str, *cells: Cell) -> None:
        raise ScheduleError(reason, self.programs, cells)

    def _try_step(self, rank: int, step: int, action: Action) -> bool:
        kind, stage, microbatch = action.kind, action.stage, action.microbatch
        if kind.is_recv:
            return self._receive(rank, step, action)
        before = _NEEDS.get(kind)
        if before is not None and (rank, before, stage, microbatch) not in self.done:
            self._fail(f"{kind.value} before its {before.value}: {action} runs before "
                       f"{stage}{before.value}{microbatch}", (rank, step))
        if kind.is_send:
            self._send(rank, step, action)
        if kind.is_per_stage and self.backwards_done[rank, stage] < self.stage_microbatches[stage]:
            self._fail(f"{action} runs before all {self.stage_microbatches[stage]} backwards of stage {stage} "
                       f"(only {self.backwards_done[rank, stage]} done)", (rank, step))
        if kind in _COMPUTE:
            assert microbatch is not None
            self.done.add((rank, kind, stage, microbatch))
            self.backwards_done[rank, stage] += kind.ends_backward
        return True

    def _send(self, rank: int, step: int, send: Action) -> None:
        producers = (ActionKind.F,) if send.kind is ActionKind.SEND_F else (ActionKind.B, ActionKind.I)
        if not any((rank, kind, send.stage, send.microbatch) in self.done for kind in producers):
            self._fail(f"{send} runs before the {' or '.join(k.value for k in producers)} that produces it "
                       f"({send.stage}{producers[0].value}{send.microbatch})", (rank, step))
        assert send.peer is not None
        for dst in self.layout.ranks_of(send.peer, self.layout.place(rank).replica):
            self.channels.setdefault((rank, dst), deque()).append((send, (rank, step)))

    def _receive(self, rank: int, step: int, recv: Action) -> bool:
        consumers = (ActionKind.F,) if recv.kind is ActionKind.RECV_F else (ActionKind.B, ActionKind.I)
        ran = [kind for kind in consumers if (rank, kind, recv.stage, recv.microbatch) in self.done]
        if ran:
            self._fail(f"{recv} runs after the {ran[0].value} that needs it", (rank, step))
        send = matching_send(recv)
        sources = self.layout.ranks_of(send.stage, self.layout.place(rank).replica)
        queues = [self.channels.get((src, rank)) for src in sources]
        if not all(queues):
            return False
        for queue in queues:
            assert queue is not None
            head, cell = queue[0]
            if head != send:
                self._fail(f"out of order: {recv} expects {send} but the next message from rank {cell[0]} "
                           f"is {head} (meant for {matching_recv(head)}); sends to one rank must follow "
                           f"the order its receives take them", (rank, step), cell)
        for queue in queues:
            assert queue is not None
            queue.popleft()
        return True

    def _explain_deadlock(self, stuck: tuple[int, ...], positions: tuple[int, ...]) -> None:
        cells = [(rank, positions[rank]) for rank in stuck]
        for rank, step in cells:
            send = matching_send(self.programs[rank][step])
            for src in self.layout.ranks_of(send.stage, self.layout.place(rank).replica):
                if send not in self.programs[src][positions[src]:] and not self.channels.get((src, rank)):
                    self._fail(f"receive without matching send: {self.programs[rank][step]} on rank {rank} waits "
                               f"for {send}, which rank {src} never sends", (rank, step))
        waits = ", ".join(f"rank {rank} at {self.programs[rank][step]}" for rank, step in cells)
        self._fail(f"deadlock: every unfinished rank waits on a receive ({waits})", *cells)


def _check_edges(programs: Programs, layout: Layout, edges: Iterable[tuple[int, int]],
                 microbatches: dict[int, tuple[int, ...]]) -> None:
    """Every rank of an edge's sender and receiver has exactly the sends and receives the edge needs."""
    expected: Counter[tuple[int, Action]] = Counter()
    forwards: dict[int, set[int]] = {}  # stage -> the micro-batches of its F's in this step (ahead ones too)
    for program in programs:
        for action in program:
            if action.kind is ActionKind.F:
                assert action.microbatch is not None
                forwards.setdefault(action.stage, set()).add(action.microbatch)
    for src, dst in edges:
        if layout.slot(src) == layout.slot(dst):
            continue
        messages = [Action(src, ActionKind.SEND_F, microbatch, peer=dst)
                    for microbatch in sorted(forwards.get(dst, ()))]
        messages += [Action(dst, ActionKind.SEND_B, microbatch, peer=src) for microbatch in microbatches[src]]
        for send in messages:
            for action in (send, matching_recv(send)):
                for replica in range(layout.data_parallel):
                    expected.update((rank, action) for rank in layout.ranks_of(action.stage, replica))
    present = Counter((rank, action) for rank, program in enumerate(programs) for action in program
                      if action.kind.is_communication)
    for rank, program in enumerate(programs):
        for step, action in enumerate(program):
            if action.kind.is_communication and present[rank, action] > expected[rank, action]:
                raise ScheduleError(f"{action} is not needed by the edges given (or appears twice)",
                                    programs, [(rank, step)])
    missing = sorted(f"{action} on rank {rank}" for (rank, action) in expected
                     if present[rank, action] < expected[rank, action])
    if missing:
        raise ScheduleError(f"communication missing for the edges given: {', '.join(missing[:8])}"
                            f"{' ...' if len(missing) > 8 else ''}", programs)
