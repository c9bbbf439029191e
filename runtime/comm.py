"""Point-to-point transfers: a run of consecutive send/receive actions becomes one batch_isend_irecv.

Receives are waited for (with a timeout) before the compute that follows them; sends stay in
flight and are waited for at the end of the step, their buffers let go earlier once complete (on gloo a
thread waits for them, :class:`SendReaper`). Messages
between two ranks match in posting order, which the plan's lowering makes identical on both
sides. On CUDA the batch is issued on a communication stream that first waits for the compute
stream; waiting on a receive makes the compute stream wait for it (no host synchronisation).

On gloo (CPU ranks) each run's receives are posted one run ahead (:class:`ReceivesAhead`,
cost_models.comm.RECEIVES_POSTED_AHEAD says why and why not on NCCL; measured: 2.7-5 ms late in a fifth of
the sends posted before their receive, under 0.4 ms when the receive was first).
"""

from __future__ import annotations

import bisect
import datetime
import queue
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cost_models.errors import PeerFailure
from planner.schedules import Action
from runtime.streams import AnyStream, current_stream, keep_alive, new_stream, use_stream


@dataclass
class Message:
    """The tensors of one communication action: payload for a send, empty buffers for a receive."""

    action: Action
    peer_rank: int
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def is_send(self) -> bool:
        return self.action.kind.is_send


@dataclass
class InFlight:
    work: dist.Work
    tensor: torch.Tensor
    label: str
    done: bool = False  # a gloo send the reaper saw complete


class SendReaper:
    """gloo only: waits for the rank's sends on a thread, in posting order, marking each done as it completes.

    A gloo send's work says it is complete only once waited for, so without this every buffer sent in a
    step stayed alive until its end (measured: six 320 KiB activations on a GPT pipeline's first rank).
    Only this thread waits on the sends (two waiters on one gloo work would take each other's completion);
    :meth:`drain` waits for it to catch up, with the timeout, and raises what a send's wait raised.
    """

    def __init__(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout
        self._queue: queue.SimpleQueue[InFlight] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: PeerFailure | None = None
        self._thread: threading.Thread | None = None

    def add(self, send: InFlight) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._reap, name="tessera-send-reaper", daemon=True)
            self._thread.start()
        with self._idle:
            self._pending += 1
        self._queue.put(send)

    def _reap(self) -> None:
        while True:
            send = self._queue.get()
            try:
                wait_for(send.work, self.timeout, send.label)
            except PeerFailure as error:
                self._error = self._error or error
            send.done = True
            del send  # this thread's reference to the buffer
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def drain(self) -> None:
        """Wait until every send added so far completed."""
        with self._idle:
            finished = self._idle.wait_for(lambda: self._pending == 0, timeout=self.timeout.total_seconds())
        if self._error is not None:
            raise self._error
        if not finished:
            raise PeerFailure(f"rank {dist.get_rank()} stopped waiting for {self._pending} sends (timeout "
                              f"{self.timeout.total_seconds():.0f} s); another rank failed or hung")


class ReceivesAhead:
    """Which runs of a program post their receives before the program reaches them: at the start, and
    with each run (before it waits), the receives of the next ``depth`` runs that have any (in program
    order, so each channel's receives keep their posting order and still match its sends one to one).

    >>> recv = (Action.parse("1RECV_F0<0"),)
    >>> ahead = ReceivesAhead([recv, Action.parse("1F0"), recv, recv], depth=2)
    >>> ahead.due(-1), ahead.due(0), ahead.due(2), ahead.due(3)
    ([0, 2], [3], [], [])
    >>> none = ReceivesAhead([recv, recv], depth=0)
    >>> none.due(-1), none.due(0), none.due(1)
    ([], [], [])
    """

    def __init__(self, segments: Sequence[Action | tuple[Action, ...]], depth: int) -> None:
        self.runs = [index for index, segment in enumerate(segments)
                     if isinstance(segment, tuple) and any(action.kind.is_recv for action in segment)]
        self.depth = depth
        self._posted = 0  # runs[:_posted] are posted

    def due(self, index: int) -> list[int]:
        """The runs whose receives to post once segment ``index`` is reached (-1: at the start)."""
        reached = bisect.bisect_right(self.runs, index)  # runs[:reached] are at or before ``index``
        due = self.runs[max(self._posted, reached):reached + self.depth]
        self._posted = max(self._posted, reached + self.depth)
        return due


class P2P:
    """Batched isend/irecv over ``group`` with timeouts; the same code on CPU (null streams) and CUDA."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, timeout_s: float) -> None:
        self.group = group
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stream: AnyStream = new_stream(device)
        self.sends: list[InFlight] = []
        self.receives: list[InFlight] = []  # posted, not yet waited for
        self.bytes_sent = 0  # every tensor posted by a send so far
        self.posted = 0  # messages (one per tensor) posted so far, sends and receives
        self.waiting_s = 0.0  # wall time :meth:`wait` spent waiting for receives so far
        self.reaper = SendReaper(self.timeout) if device.type == "cpu" else None  # gloo

    def post(self, messages: Sequence[Message]) -> list[InFlight]:
        """Post every message of the run in one batch; the sends stay in flight (:meth:`finish`), the
        receives are returned for :meth:`wait` (a coalesced NCCL batch returns its one work)."""
        ops, labels = [], []
        for message in messages:
            for tensor in message.tensors:
                op = dist.isend if message.is_send else dist.irecv
                ops.append(dist.P2POp(op, tensor, message.peer_rank, self.group))
                self.bytes_sent += tensor.numel() * tensor.element_size() if message.is_send else 0
                labels.append((message.is_send, f"{message.action} (rank {message.peer_rank})"))
        if not ops:
            return []
        self.stream.wait_stream(current_stream(self.device))
        with use_stream(self.stream):
            works = dist.batch_isend_irecv(ops)
        self.posted += len(ops)
        for op in ops:
            keep_alive(op.tensor, self.stream)
        if len(works) != len(ops):  # coalesced (NCCL): one work orders the whole batch
            label = ", ".join(label for _, label in labels)
            return [InFlight(work, ops[0].tensor, label) for work in works]
        receives = []
        for work, op, (is_send, label) in zip(works, ops, labels):
            transfer = InFlight(work, op.tensor, label)
            (self.sends if is_send else receives).append(transfer)
            if is_send and self.reaper is not None:
                self.reaper.add(transfer)
        self.receives.extend(receives)
        return receives

    def wait(self, receives: Sequence[InFlight]) -> None:
        """Wait for posted receives (with the timeout); reap the sends that have completed."""
        began = time.perf_counter()
        for receive in receives:
            wait_for(receive.work, self.timeout, receive.label)
        self.waiting_s += time.perf_counter() - began
        done = {id(receive) for receive in receives}
        self.receives = [r for r in self.receives if id(r) not in done]
        self.sends = [s for s in self.sends if not (s.done if self.reaper is not None else s.work.is_completed())]

    def finish(self) -> None:
        """Wait for every send still in flight (end of step)."""
        if self.reaper is not None:
            self.reaper.drain()
        else:
            for send in self.sends:
                wait_for(send.work, self.timeout, send.label)
        self.sends.clear()

    def in_flight(self) -> list[torch.Tensor]:
        """The buffers of posted sends and receives (what the transfers hold)."""
        return [message.tensor for message in (*self.sends, *self.receives)]


def wait_for(work: dist.Work, timeout: datetime.timedelta, label: str) -> None:
    """Wait for ``work``; a lost peer or a timeout becomes a PeerFailure naming what was awaited."""
    try:
        work.wait(timeout=timeout)
    except RuntimeError as error:  # gloo/NCCL report a lost peer or a timeout this way
        raise PeerFailure(f"rank {dist.get_rank()} stopped waiting for {label}: {type(error).__name__}: "
                          f"{backend_reason(str(error))} (timeout {timeout.total_seconds():.0f} s); "
                          f"another rank failed or hung") from error


def backend_reason(message: str) -> str:
    """The first sentence of a gloo/NCCL error, without the source location gloo puts before it:
    "[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4008: Connection reset by peer. This is
    typically caused by ..." is "Read error [127.0.0.1]:4008: Connection reset by peer"."""
    lines = message.strip().splitlines()
    first = re.sub(r"^\[[^\]]*:\d+\]\s*", "", lines[0] if lines else "")
    sentence = first.split(". ", 1)[0].rstrip(".")
    return sentence if len(sentence) <= 200 else sentence[:199] + "…"
