"""The step's global loss: every rank's micro-batch losses summed over the world, in the background.

The mean loss over the global batch needs one all-reduce a step. Waited for where the step ends, it is a
collective every rank pays on the step's critical path: 0.5-1.1 ms a step on 2 gloo CPU ranks (a data-parallel
GPT step of 120 ms). So a rank starts its part as soon as its share is final: after its last forward that
makes a loss, or, on a rank that makes none, at the step's start, and waits for the sum where the step ends.
Measured on the same step: starting it took 0.3-0.4 ms (gloo's thread runs the exchange on the rank's own
core when both ranks start together), the wait 0.04 ms. That holds on gloo, where the waiting is a thread's
of the process group. NCCL would run the collective as a kernel that spins on the GPU until every rank has
joined: there every rank starts it where its step ends (``STARTS_EARLY``).

Where it starts early it has a process group of its own (every rank: runtime/grads.py ``Groups.loss``), so
that it cannot reorder against another collective of the step; where it starts at the end, the default group.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Sequence

import torch
import torch.distributed as dist

from planner.schedules import Action, ActionKind
from runtime.comm import wait_for

STARTS_EARLY: dict[str, bool] = {"gloo": True, "nccl": False}  # per backend: whether a rank starts its part early


def start_after(segments: Sequence[Action | tuple[Action, ...]], loss_stages: Collection[int], early: bool) -> int:
    """After which of ``segments`` (an index) the rank starts the loss all-reduce: its last forward of a stage
    in ``loss_stages``, or -1 (before the first) where it has none; the last segment's index unless ``early``.

    >>> program = [Action.parse("1F0"), (Action.parse("1SEND_F0>2"),), Action.parse("1F1"), Action.parse("1B0")]
    >>> start_after(program, {1}, True), start_after(program, {2}, True), start_after(program, {1}, False)
    (2, -1, 3)
    """
    if not early:
        return len(segments) - 1
    forwards = [index for index, segment in enumerate(segments) if isinstance(segment, Action)
                and segment.kind is ActionKind.F and segment.stage in loss_stages]
    return forwards[-1] if forwards else -1


class LossReduce:
    """One step's global loss: :meth:`start` with the rank's losses (each divided by ``count``, the
    micro-batches of the global batch), :meth:`mean` waits for their sum over ``group`` (None: the default
    group; with the timeout)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, count: int, timeout_s: float) -> None:
        self.group, self.device, self.count = group, device, count
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._total: torch.Tensor | None = None
        self._work: dist.Work | None = None

    def start(self, losses: Sequence[torch.Tensor]) -> None:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.to(torch.float64)
        total /= self.count
        self._total = total
        alone = dist.get_world_size(self.group) == 1
        self._work = None if alone else dist.all_reduce(total, group=self.group, async_op=True)

    def mean(self) -> float:
        assert self._total is not None, "the loss all-reduce was not started"
        if self._work is not None:
            wait_for(self._work, self.timeout, "the loss all-reduce")
        total, self._total, self._work = self._total, None, None
        return float(total.item())
