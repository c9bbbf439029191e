"""runtime/comm.py on gloo: a sent buffer is let go once its send completes, not at the end of the step
(a gloo send's work says it is complete only once waited for: P2P's reaper thread waits for it)."""

from __future__ import annotations

import gc
import time
import weakref

import torch
import torch.distributed as dist

from planner.schedules import Action
from runtime.comm import P2P, Message
from tests.dist.harness import run_ranks


def _send_and_watch_the_buffer(rank: int, world_size: int) -> tuple[bool, int]:
    p2p = P2P(None, torch.device("cpu"), timeout_s=30.0)
    if rank == 1:
        buffer = torch.empty(4096)
        p2p.wait(p2p.post([Message(Action.parse("1RECV_F0<0"), 0, [buffer])]))
        dist.barrier()  # received
        dist.barrier()  # rank 0 looked
        p2p.finish()
        return bool(torch.equal(buffer, torch.arange(4096, dtype=torch.float32))), 0
    payload = torch.arange(4096, dtype=torch.float32)
    alive = weakref.ref(payload)
    p2p.post([Message(Action.parse("0SEND_F0>1"), 1, [payload])])
    del payload
    dist.barrier()  # rank 1 received it: the send has completed
    deadline = time.monotonic() + 5.0
    while alive() is not None and time.monotonic() < deadline:
        p2p.wait([])  # what every run of the step does: it drops the sends seen complete
        gc.collect()
        time.sleep(0.01)
    freed, held = alive() is None, len(p2p.in_flight())
    dist.barrier()
    p2p.finish()
    return freed, held


def test_a_sent_buffer_is_let_go_once_its_send_completed_before_the_step_ends() -> None:
    (freed, held), (received, _) = run_ranks(_send_and_watch_the_buffer, 2)
    assert received
    assert freed and held == 0
