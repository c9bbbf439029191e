"""Point-to-point transfers: a run of consecutive send/receive actions becomes one batch_isend_irecv.

Receives are waited for (with a timeout) before the compute that follows them; sends stay in
flight and are waited for at the end of the step (or reaped earlier once complete). Messages
between two ranks match in posting order, which the plan's lowering makes identical on both
sides. On CUDA the batch is issued on a communication stream that first waits for the compute
stream; waiting on a receive makes the compute stream wait for it (no host synchronisation).
"""

from __future__ import annotations

import datetime
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
class _InFlight:
    work: dist.Work
    tensor: torch.Tensor
    label: str


class P2P:
    """Batched isend/irecv over ``group`` with timeouts; the same code on CPU (null streams) and CUDA."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, timeout_s: float) -> None:
        self.group = group
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stream: AnyStream = new_stream(device)
        self.sends: list[_InFlight] = []
        self.bytes_sent = 0  # every tensor posted by a send so far

    def exchange(self, messages: Sequence[Message]) -> None:
        """Post every message of the run in one batch, then wait for the receives."""
        ops, labels = [], []
        for message in messages:
            for tensor in message.tensors:
                op = dist.isend if message.is_send else dist.irecv
                ops.append(dist.P2POp(op, tensor, message.peer_rank, self.group))
                self.bytes_sent += tensor.numel() * tensor.element_size() if message.is_send else 0
                labels.append((message.is_send, f"{message.action} (rank {message.peer_rank})"))
        if not ops:
            return
        self.stream.wait_stream(current_stream(self.device))
        with use_stream(self.stream):
            works = dist.batch_isend_irecv(ops)
        for op in ops:
            keep_alive(op.tensor, self.stream)
        self._settle(works, ops, labels)

    def _settle(self, works: list[dist.Work], ops: list[dist.P2POp],
                labels: list[tuple[bool, str]]) -> None:
        if len(works) != len(ops):  # coalesced (NCCL): one work orders the whole batch
            for work in works:
                wait_for(work, self.timeout, ", ".join(label for _, label in labels))
            return
        for work, op, (is_send, label) in zip(works, ops, labels):
            if is_send:
                self.sends.append(_InFlight(work, op.tensor, label))
            else:
                wait_for(work, self.timeout, label)
        self.sends = [s for s in self.sends if not s.work.is_completed()]

    def finish(self) -> None:
        """Wait for every send still in flight (end of step)."""
        for send in self.sends:
            wait_for(send.work, self.timeout, send.label)
        self.sends.clear()

    def in_flight(self) -> list[torch.Tensor]:
        return [send.tensor for send in self.sends]


def wait_for(work: dist.Work, timeout: datetime.timedelta, label: str) -> None:
    """Wait for ``work``; a lost peer or a timeout becomes a PeerFailure naming what was awaited."""
    try:
        work.wait(timeout=timeout)
    except RuntimeError as error:  # gloo/NCCL report a lost peer or a timeout this way
        lines = str(error).strip().splitlines()
        raise PeerFailure(f"rank {dist.get_rank()} stopped waiting for {label}: {type(error).__name__}: "
                          f"{lines[0][:200] if lines else ''} (timeout {timeout.total_seconds():.0f} s); "
                          f"another rank failed or hung") from error
