"""Gradient synchronisation: data-parallel all-reduce in buckets, and tied parameters across stages.

Process groups are created once, collectively and in the same order on every rank (torch
requires it), and returned to the caller: nothing is kept in module globals.

* Data parallel: one group per part over every rank holding a copy of it (the plan's layout);
  a part's gradients (tied ones
  excepted) are flattened into buckets of at most ``bucket_bytes`` and summed, two buckets in
  flight at most (a lone contiguous gradient is reduced in place, without a copy). The loss was
  already divided by (micro-batches x replicas), so the sum is the mean over the global batch.
  As DDP does, :class:`OverlappedReduce` starts them during the stage's last backward of the step:
  buckets fixed in backward (reverse parameter) order, each all-reduced as soon as its gradients are
  final (a post-accumulate-grad hook), in bucket order on every rank; ALLREDUCE then only waits.
  torch's DDP cannot express it here (a stage's several micro-batches, split I/W backwards and the
  executor's own ALLREDUCE action decide when gradients are final, not one backward call).
* Tied parameters (e.g. GPT's embedding reused as the LM head on the last part): one group
  per set of parts holding a copy, over all their ranks; the copies' gradients are summed
  so every copy takes the same step a single-process model would.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cost_models.comm import ALLREDUCE_BUCKET_BYTES, FIRST_BUCKET_BYTES
from planner.plan import Layout
from runtime.comm import wait_for
from runtime.loss_reduce import STARTS_EARLY
from runtime.streams import AnyStream, current_stream, new_stream, use_stream


@dataclass(frozen=True)
class TiedGroup:
    """Parameters held by the same set of stages, and the group over all ranks holding a copy."""

    stages: tuple[int, ...]  # the parts holding a copy
    names: tuple[str, ...]  # canonical parameter names, sorted
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None  # None on ranks outside it


@dataclass(frozen=True)
class Groups:
    """Every process group this rank takes part in, created at set-up."""

    data_parallel: Mapping[int, dist.ProcessGroup]  # part -> the group of its copies (my parts only)
    tied: tuple[TiedGroup, ...]  # every tied set (group None where this rank holds no copy)
    loss: dist.ProcessGroup | None  # the step's loss's (runtime/loss_reduce.py); None: the default group's

    @property
    def tied_names(self) -> frozenset[str]:
        return frozenset(name for group in self.tied for name in group.names)


def create_groups(layout: Layout, rank: int, stage_params: Mapping[int, set[str]],
                  timeout_s: float) -> Groups:
    """Create the data-parallel, tied-parameter and loss groups (collective: every rank must call it).

    ``stage_params`` maps each part to the canonical names of the parameters it uses.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    data_parallel = {}
    for part in range(layout.num_parts):
        ranks = layout.part_ranks(part)
        if len(ranks) > 1:
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                data_parallel[part] = group
    tied = []
    for stages, names in sorted(tied_sets(stage_params).items()):
        ranks = layout.parts_ranks(stages)  # (a rank may hold several)
        group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
        tied.append(TiedGroup(stages, names, ranks, group if rank in ranks else None))
    # a group of its own for the step's loss where a rank starts it early (NCCL's would be a communicator more)
    early = STARTS_EARLY.get(str(dist.get_backend()), False) and layout.world_size > 1
    loss = dist.new_group(list(range(layout.world_size)), timeout=timeout) if early else None
    return Groups(data_parallel, tuple(tied), loss)


def tied_sets(stage_params: Mapping[int, set[str]]) -> dict[tuple[int, ...], tuple[str, ...]]:
    """Parameters used by more than one stage, grouped by the set of stages using them."""
    holders: dict[str, list[int]] = {}
    for stage in sorted(stage_params):
        for name in stage_params[stage]:
            holders.setdefault(name, []).append(stage)
    sets: dict[tuple[int, ...], list[str]] = {}
    for name, stages in holders.items():
        if len(stages) > 1:
            sets.setdefault(tuple(stages), []).append(name)
    return {stages: tuple(sorted(names)) for stages, names in sets.items()}


class GradientSync:
    """All-reduces gradients on a side stream with timeouts; buckets by dtype and size."""

    def __init__(self, device: torch.device, timeout_s: float, bucket_bytes: int = ALLREDUCE_BUCKET_BYTES) -> None:
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.bucket_bytes = bucket_bytes
        self.stream: AnyStream = new_stream(device)

    def all_reduce(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup, label: str, *,
                   fill_missing: bool = False) -> None:
        """Sum the gradients of ``params`` over ``group``.

        Parameters without a gradient are skipped (every replica runs the same graph, so they
        agree), or given a zero gradient first with ``fill_missing`` (tied copies on stages
        whose graphs differ).
        """
        if fill_missing:
            for param in params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        self.stream.wait_stream(current_stream(self.device))
        previous: tuple[list[torch.Tensor], torch.Tensor, dist.Work] | None = None
        for bucket in _buckets(grads, self.bucket_bytes):  # at most two buckets alive at once
            with use_stream(self.stream):
                flat = bucket[0] if len(bucket) == 1 and bucket[0].is_contiguous() else torch.cat(
                    [g.reshape(-1) for g in bucket])
                work = dist.all_reduce(flat, group=group, async_op=True)
            if previous is not None:
                self.unpack(*previous, label)
            previous = (bucket, flat, work)
        if previous is not None:
            self.unpack(*previous, label)
        current_stream(self.device).wait_stream(self.stream)

    def unpack(self, bucket: list[torch.Tensor], flat: torch.Tensor, work: dist.Work, label: str) -> None:
        with use_stream(self.stream):
            wait_for(work, self.timeout, f"the {label} all-reduce")
            if flat is bucket[0]:  # reduced in place
                return
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

class OverlappedReduce:
    """One stage's all-reduce, started during its last backward of each step (see the module docstring).

    Made once per stage (its hooks stay registered and return at once unless armed). Before the step's
    last backward, :meth:`arm` it with that backward's roots (parameters its graph does not reach are
    final already, as DDP's ``find_unused_parameters`` finds; the stage's graph is the same every step,
    so the walk is done once); at the stage's ALLREDUCE, :meth:`wait`. A parameter without any gradient
    is skipped, as the optimizer skips it."""

    def __init__(self, sync: GradientSync, params: Sequence[nn.Parameter], group: dist.ProcessGroup,
                 label: str) -> None:
        self.sync, self.group, self.label = sync, group, label
        ordered = list(reversed(params))  # roughly the order the backward finishes them
        self.buckets = _buckets(ordered, sync.bucket_bytes, min(FIRST_BUCKET_BYTES, sync.bucket_bytes))
        self.bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket}
        self.unreached: list[int] | None = None  # per bucket, its parameters the last backward does not reach
        self.missing: list[int] = []
        self.launched: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work | None]] = []
        self.armed = False
        for param in ordered:
            param.register_post_accumulate_grad_hook(self._ready)

    def arm(self, roots: Sequence[torch.Tensor]) -> None:
        """The stage's last backward of the step is about to run from ``roots``."""
        if self.unreached is None:
            reached = _leaves_reached(roots)
            self.unreached = [sum(id(param) not in reached for param in bucket) for bucket in self.buckets]
        self.missing = [len(bucket) - unreached for bucket, unreached in zip(self.buckets, self.unreached)]
        self.launched = []
        self.armed = True
        self._launch(all_ready=False)

    def _ready(self, param: torch.Tensor) -> None:
        if self.armed:
            self.missing[self.bucket_of[id(param)]] -= 1
            self._launch(all_ready=False)

    def _launch(self, *, all_ready: bool) -> None:
        """Launch the buckets whose gradients are all final, in bucket order (every rank alike)."""
        while len(self.launched) < len(self.buckets) and (all_ready or not self.missing[len(self.launched)]):
            bucket = self.buckets[len(self.launched)]
            grads = [param.grad for param in bucket if param.grad is not None]  # the replicas agree on which
            if not grads:
                self.launched.append(([], torch.empty(0), None))
                continue
            self.sync.stream.wait_stream(current_stream(self.sync.device))
            with use_stream(self.sync.stream):
                flat = grads[0] if len(grads) == 1 and grads[0].is_contiguous() else torch.cat(
                    [g.reshape(-1) for g in grads])
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            self.launched.append((grads, flat, work))

    def wait(self) -> None:
        """Launch what is left, wait for every bucket and write the sums back into the gradients."""
        self.armed = False
        self._launch(all_ready=True)
        for grads, flat, work in self.launched:
            if work is not None:
                self.sync.unpack(grads, flat, work, self.label)
        self.launched = []
        current_stream(self.sync.device).wait_stream(self.sync.stream)


def _leaves_reached(roots: Sequence[torch.Tensor]) -> set[int]:
    """The ids of the leaves a backward from ``roots`` accumulates into (its graph's AccumulateGrad nodes)."""
    reached: set[int] = set()
    seen: set[object] = set()
    stack = [root.grad_fn for root in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(following for following, _ in node.next_functions)
    return reached


def _buckets(grads: Sequence[torch.Tensor], bucket_bytes: int,
             first_bytes: int | None = None) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``grads`` of one dtype and at most ``bucket_bytes`` (the first ``first_bytes``);
    a tensor larger than that is a bucket of its own."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        cap = first_bytes if len(buckets) == 1 and first_bytes is not None else bucket_bytes
        if not buckets or buckets[-1][0].dtype != grad.dtype or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return buckets
