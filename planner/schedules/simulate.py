"""Simulator: replays lowered programs on per-stage costs to predict step time, bubble and memory.

Model: programs are per rank of the whole job (the layout says which stages each rank runs and
between which ranks a message travels). Each rank runs its actions in order on one compute
resource. F, B, OPTIMIZER_STEP take their stage's time and count as busy (a split backward's I
takes ``bwd_ms - weight_grad_ms + split_extra_ms`` and its W ``weight_grad_ms``); ALLREDUCE takes
``allreduce_ms`` once every copy of the part has reached it and blocks the rank, but is
communication, not busy time. A stage whose all-reduce runs in buckets during its last
backward (``allreduce_overlap``, DDP's overlap) starts the buckets before the last one with that
backward and the last one when it ends: ALLREDUCE then ends at
``max(first + overlap x A, last) + (1 - overlap) x A`` (the last backward from first to last, A
the all-reduce's time), or when the rank reaches it if later. It is a collective: every rank holding
a copy of the part ends it when the last of them would end its own (replicas in step end together;
GEMS-MASTER's mirror copies, which reach it at different times, wait for each other). Before a rank's first
OPTIMIZER_STEP of the step, each tied sum it takes part in (``tied_sums``: a weight whose copies several parts
hold, in the runtime's order) is such a collective too, over every rank holding one of its parts. A SEND costs
the rank the time to post it (``post_ms``: on gloo the rank's own core posts each message; 0 where
the host queues it ahead of the GPU), then returns and starts a transfer on the directed link
src rank → dst rank; transfers on one link run one after another (FIFO). A RECV costs its post too
and blocks until its transfer has arrived (a receive posted ahead of its place pays its post while
the rank would wait anyway: ``max(post, arrival)``).
A message between stages of different slots travels from every rank of the sender to every rank
of the receiver (spatial tiles join and split), each at the edge's cost, and the receive waits
for all of them. Memory per rank is the static bytes of its stages plus ``activation_bytes`` for
each micro-batch from the start of its F to the end of its B (or W: the weight gradient reads the
saved inputs, so a split backward frees the micro-batch only after both halves; what its I keeps for its W,
``split_kept_bytes``, is held from I's end to W's end, and from an I's end until the rank's next F or I the
stage's largest transient is not, a W's working set in its place: ``split_relief_bytes``). A micro-batch whose F
ran in the previous step (a carried forward, planner/schedules/periods.py) is held from the step's
start; one whose F runs ahead for the next step, until its end. A stage's ``grad_bytes`` (part of its
static bytes) exist from the end of its first B (or W) of the step, whose activations go as its gradients
come (both at its end; while it runs, its ``first_backward_bytes`` count the gradients made so far and its
worst node's working set beside the activations not yet gone), to the end of its optimizer step,
which frees them (``zero_grad(set_to_none=True)``); while the step runs, its buffers (``step_bytes``: a
bucket's gradients in the masters' dtype, the optimizer's temporaries) are held too.

Swaps: a stage that swaps copies ``swap_bytes`` per micro-batch to the host, starting with its F,
on the rank's device-to-host copy engine (one copy at a time, ``swap_ms`` each); ``SWAP_OUT``
waits for that copy, and the bytes leave the device when it ends. ``SWAP_IN`` starts the copy back
on the host-to-device engine (the bytes return when it starts) and the micro-batch's B waits for it.
Recomputation is inside B's time. A receive is paired with its send by what it carries (kind, micro-batch,
stages); that the order on each channel matches is :func:`validate`'s job, so simulate
validated programs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from planner.plan.layout import Layout
from planner.plan.parts import TiedSum
from planner.schedules.actions import Action, ActionKind, Programs
from planner.schedules.periods import Periods
from planner.schedules.replay import replay, stuck_ranks
from planner.schedules.validate import ScheduleError

COMPUTE_LANE = "compute"
COMM_LANE = "comm"
COPY_LANE = "copy"  # host <-> device copies (swaps)
_BUSY_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.OPTIMIZER_STEP,
                         ActionKind.RECOMPUTE})
# The kinds the replay tests per action, looked up once (reading ``ActionKind.F`` calls a descriptor on
# Python 3.11, and a replay tests several kinds for each of its hundred thousand actions).
_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_ALLREDUCE, _OPTIMIZER_STEP = ActionKind.ALLREDUCE, ActionKind.OPTIMIZER_STEP
_SWAPS = frozenset({ActionKind.SWAP_OUT, ActionKind.SWAP_IN})
_GRADIENT_KINDS = frozenset({ActionKind.SEND_B, ActionKind.RECV_B})

Message = tuple[bool, int, int, "int | None"]
"""What a send or a receive carries, alike at both ends: (gradients?, sending stage, receiving stage,
micro-batch). A receive takes the send that carries the same (:func:`_message`)."""


@dataclass(frozen=True)
class StageCosts:
    """What one stage costs per step and per micro-batch."""

    fwd_ms: float
    bwd_ms: float
    activation_bytes: int  # held per micro-batch in flight (from its F start until its B finishes)
    static_bytes: int  # weights, gradients, optimizer state, buffers: held all the time
    allreduce_ms: float = 0.0
    optimizer_ms: float = 0.0
    swap_bytes: int = 0  # per micro-batch, to the host after F and back before B
    swap_ms: float = 0.0  # per micro-batch, each way
    weight_grad_ms: float = 0.0  # what a split backward's W takes (its I: the rest of bwd_ms, + split_extra_ms)
    allreduce_overlap: float = 0.0  # the share of allreduce_ms in buckets that start during the last backward
    grad_bytes: int = 0  # of static_bytes: the gradients, from the stage's first backward to its optimizer step
    step_bytes: int = 0  # during its optimizer step: its buffers, above static_bytes
    tied_bytes: int = 0  # at each backward's end, after its micro-batch's activations went: tied partial gradients
    accumulate_bytes: int = 0  # at the start of a backward adding into its gradients: a node's new weight gradient
    split_extra_ms: float = 0.0  # what a split backward's I and W take beyond bwd_ms (measured)
    first_backward_bytes: int = 0  # during the step's first backward: the gradients made so far, and what its
    # worst node works in beyond the transient (its activations not yet gone)
    split_kept_bytes: int = 0  # per micro-batch, from a split backward's I's end to its W's end: what I kept for W
    split_relief_bytes: int = 0  # of static_bytes, the largest transient less a W's working set: not held from
    # an I's end until the rank's next F or I (a W adds nothing at its start: its working set is in its place)


@dataclass(frozen=True)
class SimCosts:
    """Costs of every stage and of every tensor crossing; edges missing from ``transfer_ms`` cost 0."""

    stages: tuple[StageCosts, ...]
    transfer_ms: Mapping[tuple[int, int], float]  # (src_stage, dst_stage) -> ms per micro-batch, either way
    post_ms: Mapping[tuple[int, int], float] = field(default_factory=dict)  # what posting it costs each end
    tied_sums: tuple[TiedSum, ...] = ()  # tied weights' gradients summed before each rank's first optimizer step


@dataclass(frozen=True)
class SimEvent:
    """One executed action on the timeline."""

    rank: int
    action: str
    start_ms: float
    end_ms: float
    lane: str  # "compute" or "comm"


@dataclass(frozen=True)
class SimResult:
    """What one simulated training step took."""

    step_ms: float
    bubble_fraction: float
    busy_ms: tuple[float, ...]
    peak_mem_bytes: tuple[int, ...]
    memory_timeline: tuple[tuple[tuple[float, int], ...], ...]  # per rank: (t_ms, bytes) after each change
    events: tuple[SimEvent, ...]

    @property
    def num_ranks(self) -> int:
        return len(self.busy_ms)


def simulate(programs: Programs, layout: Layout, costs: SimCosts) -> SimResult:
    """Replay lowered programs (one per rank) on costs.

    >>> from planner.schedules.generate import gpipe
    >>> from planner.schedules.lower import lower
    >>> s = gpipe(2, 2)
    >>> programs = s.layout.rank_programs(lower(s.programs, s.layout, {(0, 1)}))
    >>> stage = StageCosts(fwd_ms=1.0, bwd_ms=2.0, activation_bytes=10, static_bytes=100)
    >>> result = simulate(programs, s.layout, SimCosts((stage, stage), {}))
    >>> result.step_ms, round(result.bubble_fraction, 3), result.peak_mem_bytes
    (9.0, 0.333, (120, 120))
    """
    return _replayed(programs, layout, costs, _Clocks).result()


def simulated_step_ms(programs: Programs, layout: Layout, costs: SimCosts) -> float:
    """:func:`simulate`'s ``step_ms`` alone: the same replay without recording its timeline and memory
    (a third of its work), for callers that need the step only (planner/schedules/balanced.py).

    >>> from planner.schedules.generate import gpipe
    >>> from planner.schedules.lower import lower
    >>> s = gpipe(2, 2)
    >>> programs = s.layout.rank_programs(lower(s.programs, s.layout, {(0, 1)}))
    >>> simulated_step_ms(programs, s.layout, SimCosts((StageCosts(1.0, 2.0, 10, 100),) * 2, {}))
    9.0
    """
    return _replayed(programs, layout, costs, _StepClocks).step_ms()


def _replayed(programs: Programs, layout: Layout, costs: SimCosts, clocks: type[_Clocks]) -> _Clocks:
    """``clocks`` after replaying ``programs`` to their ends (ScheduleError where ranks wait forever)."""
    if len(costs.stages) != layout.num_stages:
        raise ValueError(f"costs give {len(costs.stages)} stages but the layout has {layout.num_stages}")
    if len(programs) != layout.world_size:
        raise ValueError(f"got {len(programs)} programs for {layout.world_size} ranks")
    state = clocks(layout, costs, Periods.of(programs))
    positions = replay(programs, state.try_step)
    stuck = stuck_ranks(programs, positions)
    if stuck:
        waits = ", ".join(f"rank {rank} at {programs[rank][positions[rank]]}" for rank in stuck)
        raise ScheduleError(f"cannot simulate: ranks wait forever ({waits}); run validate() for the reason",
                            programs, [(rank, positions[rank]) for rank in stuck])
    return state


@dataclass
class _Clocks:
    """Mutable state of one simulation: per-rank clocks, link availability, arrivals, memory."""

    layout: Layout
    costs: SimCosts
    periods: Periods
    clock_ms: list[float] = field(default_factory=list)
    busy_ms: list[float] = field(default_factory=list)
    memory: list[list[tuple[float, int]]] = field(default_factory=list)
    link_free_ms: dict[tuple[int, int], float] = field(default_factory=dict)
    arrival_ms: dict[tuple[Message, int, int], float] = field(default_factory=dict)  # (message, src, dst)
    events: list[SimEvent] = field(default_factory=list)
    copy_free_ms: dict[tuple[int, str], float] = field(default_factory=dict)  # (rank, "out"/"in")
    copied_ms: dict[tuple[int, str, int, int], float] = field(default_factory=dict)  # (rank, way, stage, mb)
    last_backward_ms: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # (rank, stage)
    reduce_reached_ms: dict[int, dict[int, tuple[float, float]]] = field(default_factory=dict)  # part: rank: own

    def __post_init__(self) -> None:
        ranks = range(self.layout.world_size)
        self.clock_ms = [0.0 for _ in ranks]
        self.busy_ms = [0.0 for _ in ranks]
        self.memory = [[(0.0, self._activation_bytes(stage)) for stage in self.layout.stages_of_rank(rank)
                        for _ in self.periods.carried_on(stage)] for rank in ranks]  # (time, change) after static
        self.grads_made: set[tuple[int, int]] = set()  # (rank, stage): this step's backward allocated them
        self.relieved = [0 for _ in ranks]  # per rank: the transient an I's end let go (split_relief_bytes)
        # The layout's and the costs' answers the replay asks per action, looked up once:
        self.replica = [self.layout.place(rank).replica for rank in ranks]  # per rank
        self.stage_ranks = [[self.layout.ranks_of(stage, replica) for stage in range(self.layout.num_stages)]
                            for replica in range(self.layout.data_parallel)]  # [replica][stage]: its ranks
        # the tied sums each rank takes part in, in the runtime's order (a sum all of whose copies one rank
        # holds is none), the next it waits in, and per sum when each of its ranks reached it
        self.tied_ranks = [self.layout.parts_ranks(tied.parts) for tied in self.costs.tied_sums]
        self.tied_of_rank = [[index for index, members in enumerate(self.tied_ranks)
                              if len(members) > 1 and rank in members] for rank in ranks]
        self.tied_next = [0 for _ in ranks]
        self.tied_reached: list[dict[int, float]] = [{} for _ in self.costs.tied_sums]
        self.duration_ms = [{_F: stage.fwd_ms, _B: stage.bwd_ms,
                             _I: stage.bwd_ms - stage.weight_grad_ms + stage.split_extra_ms,
                             _W: stage.weight_grad_ms, _OPTIMIZER_STEP: stage.optimizer_ms}
                            for stage in self.costs.stages]  # [stage][kind]; other kinds take no time

    def _activation_bytes(self, stage: int) -> int:
        """What a stage holds for one micro-batch from its F until its backward ends."""
        return self.costs.stages[stage].activation_bytes + self.costs.stages[stage].swap_bytes

    def _static_bytes(self, rank: int) -> int:
        """What the rank holds at the step's start: its stages' static bytes but their gradients (the last
        step's optimizer step freed them)."""
        return sum(self.costs.stages[stage].static_bytes - self.costs.stages[stage].grad_bytes
                   for stage in self.layout.stages_of_rank(rank))

    def try_step(self, rank: int, step: int, action: Action) -> bool:
        kind = action.kind
        if kind.is_recv:
            return self._receive(rank, action)
        if kind is _ALLREDUCE:
            return self._all_reduce(rank, action)
        if kind is _OPTIMIZER_STEP and not self._tied_summed(rank, action):
            return False
        if kind.is_send:
            self._send(rank, action)
        else:
            self._run_locally(rank, action)
        return True

    def _receive(self, rank: int, recv: Action) -> bool:
        message = _message(recv)
        sources = self._ranks_of(message[1], rank)
        arrivals = [self.arrival_ms.get((message, src, rank)) for src in sources]
        if any(arrival is None for arrival in arrivals):
            return False
        start = self.clock_ms[rank]
        posted = start + len(sources) * self.costs.post_ms.get(_edge(message), 0.0)
        self.clock_ms[rank] = max(posted, *arrivals)
        self._record(rank, recv, start, self.clock_ms[rank], COMM_LANE)
        return True

    def _send(self, rank: int, send: Action) -> None:
        message = _message(send)
        edge = _edge(message)
        post_ms, transfer_ms = self.costs.post_ms.get(edge, 0.0), self.costs.transfer_ms.get(edge, 0.0)
        for dst in self._ranks_of(message[2], rank):
            self.clock_ms[rank] += post_ms
            start = max(self.clock_ms[rank], self.link_free_ms.get((rank, dst), 0.0))
            end = start + transfer_ms
            self.link_free_ms[rank, dst] = end
            self.arrival_ms[message, rank, dst] = end
            self._record(rank, send, start, end, COMM_LANE)

    def _ranks_of(self, stage: int, rank: int) -> tuple[int, ...]:
        """The ranks that run ``stage`` in ``rank``'s replica."""
        replica = self.replica[rank]
        try:
            return self.stage_ranks[replica][stage]
        except IndexError:
            return self.layout.ranks_of(stage, replica)  # which says what is out of range

    def _run_locally(self, rank: int, action: Action) -> None:
        stage = self.costs.stages[action.stage]
        kind = action.kind
        if kind in _SWAPS:
            self._swap(rank, action, stage)
            return
        start = self.clock_ms[rank]
        if kind.computes_input_grads:
            start = max(start, self.copied_ms.get((rank, "in", action.stage, action.microbatch), start))
        end = start + self.duration_ms[action.stage].get(kind, 0.0)
        ends_backward = kind.ends_backward
        if ends_backward:
            self.last_backward_ms[rank, action.stage] = (start, end)
        self.clock_ms[rank] = end
        activation = self._activation_bytes(action.stage)
        if self.relieved[rank] and kind is not _W:  # the largest transient may be back
            self._change_memory(rank, start, self.relieved[rank])
            self.relieved[rank] = 0
        if kind is _B or kind is _W:  # a backward's worst moment, at its start
            made = (rank, action.stage) in self.grads_made  # then added into the gradients; else making them
            if kind is _W and stage.split_kept_bytes:  # its working set is held since the I
                extra = 0  # ended; the gradients it makes come as it frees what it read (measured: a 3-rank
                # ResNet's stages came 2.5-9% under a plan adding the gradients at its start)
            else:  # (above the static bytes with their transient)
                extra = stage.accumulate_bytes if made else stage.first_backward_bytes
            if extra:
                self._change_memory(rank, start, extra)
                self._change_memory(rank, start, -extra)
        if kind is _F:
            self._change_memory(rank, start, activation)
            if stage.swap_bytes:
                self._copy(rank, "out", action, start, stage.swap_ms)
        elif ends_backward:
            self._change_memory(rank, end, -activation)
        if kind is _I:  # what it keeps for its W; its largest transient gone
            self._change_memory(rank, end, stage.split_kept_bytes - stage.split_relief_bytes)
            self.relieved[rank] = stage.split_relief_bytes
        elif kind is _W:
            self._change_memory(rank, end, -stage.split_kept_bytes)
        if (kind is _B or kind is _W) and (rank, action.stage) not in self.grads_made:
            self.grads_made.add((rank, action.stage))  # it frees activations as it writes gradients: both at its end
            self._change_memory(rank, end, stage.grad_bytes)
        if ends_backward and stage.tied_bytes:  # summed at the end, then added to the gradients
            self._change_memory(rank, end, stage.tied_bytes)
            self._change_memory(rank, end, -stage.tied_bytes)
        if kind is _OPTIMIZER_STEP:  # its buffers while it runs; then the gradients are None
            self._change_memory(rank, start, stage.step_bytes)
            self._change_memory(rank, end, -stage.step_bytes - stage.grad_bytes)
        if kind in _BUSY_KINDS:
            self.busy_ms[rank] += end - start
            self._record(rank, action, start, end, COMPUTE_LANE)
        else:
            self._record(rank, action, start, end, COMM_LANE)

    def _all_reduce(self, rank: int, action: Action) -> bool:
        """A collective of every rank holding a copy of the stage's part: each reaches it (its buckets
        before the last start with its last backward where they overlap it), and all end when the last
        to finish its own share does (GEMS's mirror copies reach theirs at different times)."""
        stage = self.costs.stages[action.stage]
        part = self.layout.part(action.stage)
        reached = self.reduce_reached_ms.setdefault(part, {})
        if rank not in reached:  # the rank waits here from now: its own share's start and end, once
            start = self.clock_ms[rank]
            end = start + stage.allreduce_ms
            if stage.allreduce_overlap and (rank, action.stage) in self.last_backward_ms:
                first, last = self.last_backward_ms[rank, action.stage]  # its last backward's start and end
                overlap = stage.allreduce_overlap
                start = first
                end = max(self.clock_ms[rank], max(first + overlap * stage.allreduce_ms, last)
                          + (1 - overlap) * stage.allreduce_ms)
            reached[rank] = (start, end)
        if len(reached) < len(self.layout.part_ranks(part)):
            return False
        start, _ = reached[rank]
        self.clock_ms[rank] = max(end for _, end in reached.values())
        self._record(rank, action, start, self.clock_ms[rank], COMM_LANE)
        return True

    def _tied_summed(self, rank: int, action: Action) -> bool:
        """Before a rank's first optimizer step, each tied sum it takes part in, in order: a collective of every
        rank holding a copy, which ends its time after the last of them reached it (recorded as the stage's
        all-reduce). False while one waits for a rank still to come."""
        mine = self.tied_of_rank[rank]
        while self.tied_next[rank] < len(mine):
            index = mine[self.tied_next[rank]]
            reached = self.tied_reached[index]
            reached.setdefault(rank, self.clock_ms[rank])
            if len(reached) < len(self.tied_ranks[index]):
                return False
            end = max(reached.values()) + self.costs.tied_sums[index].ms
            self._record(rank, Action(action.stage, _ALLREDUCE), reached[rank], end, COMM_LANE)
            self.clock_ms[rank] = end
            self.tied_next[rank] += 1
        return True

    def _copy(self, rank: int, way: str, action: Action, ready_ms: float, duration_ms: float) -> float:
        """A copy on the rank's engine for ``way``, after ``ready_ms`` and the engine's previous copy."""
        start = max(ready_ms, self.copy_free_ms.get((rank, way), 0.0))
        end = start + duration_ms
        self.copy_free_ms[rank, way] = end
        assert action.microbatch is not None
        self.copied_ms[rank, way, action.stage, action.microbatch] = end
        self._record(rank, Action(action.stage, ActionKind.SWAP_OUT if way == "out" else ActionKind.SWAP_IN,
                                  action.microbatch), start, end, COPY_LANE)
        return start

    def _swap(self, rank: int, action: Action, stage: StageCosts) -> None:
        """SWAP_OUT waits for the micro-batch's copy to the host; SWAP_IN starts the copy back."""
        now = self.clock_ms[rank]
        if action.kind is ActionKind.SWAP_OUT:
            done = self.copied_ms.get((rank, "out", action.stage, action.microbatch), now)
            self.clock_ms[rank] = max(now, done)
            self._change_memory(rank, self.clock_ms[rank], -stage.swap_bytes)
        else:
            start = self._copy(rank, "in", action, now, stage.swap_ms)
            self._change_memory(rank, max(now, start), stage.swap_bytes)

    def _change_memory(self, rank: int, time_ms: float, delta_bytes: int) -> None:
        """Memory changes are logged as they are simulated, which may be out of time order (a swap's
        bytes return when its copy starts): the peak is taken after sorting by time."""
        self.memory[rank].append((time_ms, delta_bytes))

    def _record(self, rank: int, action: Action, start: float, end: float, lane: str) -> None:
        self.events.append(SimEvent(rank, str(action), start, end, lane))

    def result(self) -> SimResult:
        step_ms = max((event.end_ms for event in self.events), default=0.0)
        capacity = step_ms * self.layout.world_size
        bubble = 1.0 - sum(self.busy_ms) / capacity if capacity > 0 else 0.0
        timelines = tuple(_running(self._static_bytes(rank), changes) for rank, changes in enumerate(self.memory))
        return SimResult(step_ms=step_ms, bubble_fraction=bubble, busy_ms=tuple(self.busy_ms),
                         peak_mem_bytes=tuple(max(nbytes for _, nbytes in timeline) for timeline in timelines),
                         memory_timeline=timelines,
                         events=tuple(sorted(self.events, key=lambda event: (event.start_ms, event.rank))))


class _StepClocks(_Clocks):
    """The clocks that keep the latest end of anything run (the step) instead of the timeline and memory."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.last_end_ms: float | None = None  # None until something ran

    def _record(self, rank: int, action: Action, start: float, end: float, lane: str) -> None:
        if self.last_end_ms is None or end > self.last_end_ms:  # as max() over the events picks
            self.last_end_ms = end

    def _change_memory(self, rank: int, time_ms: float, delta_bytes: int) -> None:
        pass

    def step_ms(self) -> float:
        """What :meth:`_Clocks.result` gives as ``step_ms``."""
        return 0.0 if self.last_end_ms is None else self.last_end_ms


def _running(static_bytes: int, changes: list[tuple[float, int]]) -> tuple[tuple[float, int], ...]:
    """(time, bytes held) at 0 and after each change, in time order (changes at one instant in the
    order the programs made them)."""
    held, timeline = static_bytes, [(0.0, static_bytes)]
    for time_ms, delta in sorted(changes, key=lambda change: change[0]):
        held += delta
        timeline.append((time_ms, held))
    return tuple(timeline)


def _message(action: Action) -> Message:
    """What a send or a receive carries (its two ends give the same)."""
    assert action.peer is not None
    gradients = action.kind in _GRADIENT_KINDS
    if action.kind.is_send:
        return gradients, action.stage, action.peer, action.microbatch
    return gradients, action.peer, action.stage, action.microbatch


def _edge(message: Message) -> tuple[int, int]:
    """The (src_stage, dst_stage) edge a message travels, gradients included."""
    gradients, sender, receiver, _ = message
    return (receiver, sender) if gradients else (sender, receiver)
