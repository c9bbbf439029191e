"""ZeRO sharding of one stage's parameters over its data-parallel replicas: chunks, gathers, reductions.

Conventions: every sharded parameter is flattened and padded with zeros to a multiple of the
group size ``world``; rank ``r`` of the group owns chunk ``r`` (``chunk_numel = ceil(numel /
world)`` elements). One collective moves every parameter of the stage at once: its buffer is
rank-major, ``(world, sum of chunk_numel)``, so rank ``r``'s row is the concatenation of its
chunks in parameter order (``all_gather_single``/``reduce_scatter_single``, both of which gloo
and NCCL run). Padding elements stay zero: their gradients are zero, so SGD, momentum and Adam
leave them at zero.

Why not FSDP2 (``torch.distributed.fsdp.fully_shard``): it runs on CPU with gloo in torch 2.13,
but it replaces each module's parameters with new DTensor parameters, while the executor feeds
get_attr parameters (GPT's tied LM head) to a stage as explicit inputs and sums tied gradients
across stages on whole tensors: after ``fully_shard`` the tensor fed as the head is no longer the
embedding's parameter (checked: ``head is emb.weight`` is False, its gradient lands on the stale
copy), and FSDP2 always reduce-scatters, so ZeRO-1 (all-reduce, sharded optimizer only) is not
one of its modes. Hence this module: plain tensors, storage freed in place for ZeRO-3, so every
reference to a parameter (module attribute, get_attr input, optimizer) stays the same object.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cost_models.memory import shard_numel
from runtime.comm import wait_for


@dataclass(frozen=True)
class ShardLayout:
    """Which elements of each parameter rank ``rank`` of a group of ``world`` owns."""

    numels: tuple[int, ...]
    world: int
    rank: int

    def chunk_numel(self, index: int) -> int:
        return shard_numel(self.numels[index], self.world)

    @property
    def row_numel(self) -> int:
        """Elements of one rank's row in a collective buffer (its chunks, concatenated)."""
        return sum(self.chunk_numel(index) for index in range(len(self.numels)))

    def padded(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """``full`` flattened and zero-padded to ``world`` chunks, shaped ``(world, chunk_numel)``."""
        flat = full.reshape(-1)
        pad = self.chunk_numel(index) * self.world - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(self.world, -1)

    def chunk(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``full`` (a new tensor, flat)."""
        return self.padded(index, full)[self.rank].clone()

    def unpad(self, index: int, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The parameter from its ``(world, chunk_numel)`` chunks."""
        return rows.reshape(-1)[:self.numels[index]].view(shape)


class ShardGroup:
    """The collectives of one stage's ZeRO group, each waited for with the executor's timeout.

    With ``staged``, a collective's input and output live in buffers the group keeps (grown to the largest
    asked for, one per role and dtype; a gather started ahead has its own) instead of new tensors: ZeRO-3's
    layer-by-layer collectives, hundreds a step, allocate none of them each, and the results are views of those
    buffers, valid until the next staged collective of their role. On gloo a staged reduce-scatter is an
    all-reduce of the table in place, this rank's row then copied out (twice the bytes on the wire, costed so:
    planner/search/terms.py): gloo's reduce-scatter copies its input into a temporary that its worker thread often
    frees, outside what the CPU meter records (runtime/memory.py), so a step of hundreds of them measured up to 20%
    above what it held; its in-place all-reduce allocates nothing.
    """

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._staging: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._in_place_sums = dist.get_backend(group) == "gloo"  # staged reduce-scatters (see above)

    def _buffer(self, role: str, numel: int, like: torch.Tensor, staged: bool) -> torch.Tensor:
        """A flat tensor of ``numel`` elements of ``like``'s dtype and device: new, or a view of the kept one."""
        if not staged:
            return like.new_empty(numel)
        key = (role, like.dtype)
        kept = self._staging.get(key)
        if kept is None or kept.numel() < numel:
            kept = self._staging[key] = like.new_empty(numel)
        return kept[:numel]

    def staged_tensors(self) -> list[torch.Tensor]:
        """The buffers staged collectives keep (memory the rank holds between them)."""
        return list(self._staging.values())

    def layout(self, numels: Sequence[int]) -> ShardLayout:
        return ShardLayout(tuple(numels), self.world, self.rank)

    def all_gather(self, layout: ShardLayout, chunks: Sequence[torch.Tensor], label: str, *,
                   staged: bool = False, device: torch.device | None = None) -> list[torch.Tensor]:
        """Every rank's chunks -> each parameter's ``(world, chunk_numel)`` rows (padding kept), on ``device``
        (default the chunks'; chunks on the host are copied up first: ZeRO-Infinity's parameters on the host)."""
        return self.start_all_gather(layout, chunks, label, staged=staged, device=device).finish()

    def start_all_gather(self, layout: ShardLayout, chunks: Sequence[torch.Tensor], label: str, *,
                         staged: bool = False, ahead: bool = False,
                         device: torch.device | None = None) -> PendingGather:
        """:meth:`all_gather` started, its rows taken by :meth:`PendingGather.finish`; ``ahead``: into staged
        buffers of their own, so that the gather runs while others start and finish (ZeRO-3's prefetch)."""
        flat = [chunk.reshape(-1) for chunk in chunks]
        like = flat[0] if device is None else flat[0].new_empty(0, device=device)
        roles = ("row ahead", "rows ahead") if ahead else ("row", "rows")
        row = self._buffer(roles[0], layout.row_numel, like, staged or ahead)
        if all(chunk.device == row.device for chunk in flat):
            torch.cat(flat, out=row)
        else:
            start = 0
            for chunk in flat:
                row[start:start + chunk.numel()].copy_(chunk, non_blocking=True)  # (pinned host chunks)
                start += chunk.numel()
        rows = self._buffer(roles[1], self.world * row.numel(), row, staged or ahead)
        work = dist.all_gather_single(rows, row, group=self.group, async_op=True)
        return PendingGather(work, rows.view(self.world, -1), layout, self.timeout, f"the {label} all-gather")

    def reduce_scatter(self, layout: ShardLayout, fulls: Sequence[torch.Tensor], label: str, *,
                       staged: bool = False) -> list[torch.Tensor]:
        """Sum ``fulls`` over the group; this rank keeps its chunk of each sum (flat: new tensors, or views of a
        kept buffer if ``staged``)."""
        padded = [layout.padded(index, full) for index, full in enumerate(fulls)]
        table = self._buffer("table", self.world * layout.row_numel, padded[0], staged).view(self.world, -1)
        torch.cat(padded, dim=1, out=table)
        del padded
        mine = self._buffer("mine", layout.row_numel, table, staged)
        if staged and self._in_place_sums:
            wait_for(dist.all_reduce(table, group=self.group, async_op=True), self.timeout, f"the {label} sum")
            mine.copy_(table[self.rank])
        else:
            wait_for(dist.reduce_scatter_single(mine, table.reshape(-1), group=self.group, async_op=True),
                     self.timeout, f"the {label} reduce-scatter")
        offsets = _offsets(layout)
        return [mine[start:start + layout.chunk_numel(index)] for index, start in enumerate(offsets)]


@dataclass(frozen=True)
class PendingGather:
    """An all-gather started (:meth:`ShardGroup.start_all_gather`), its rows valid once :meth:`finish` returns."""

    work: dist.Work
    table: torch.Tensor
    layout: ShardLayout
    timeout: datetime.timedelta
    label: str

    def finish(self) -> list[torch.Tensor]:
        """Wait for it: each parameter's ``(world, chunk_numel)`` rows (views of its buffer)."""
        wait_for(self.work, self.timeout, self.label)
        offsets = _offsets(self.layout)
        return [self.table[:, start:start + self.layout.chunk_numel(index)] for index, start in enumerate(offsets)]


def _offsets(layout: ShardLayout) -> list[int]:
    offsets, total = [], 0
    for index in range(len(layout.numels)):
        offsets.append(total)
        total += layout.chunk_numel(index)
    return offsets


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory but keep the tensor object (ZeRO-3 between uses).

    The storage is resized in place, not swapped, so autograd's saved reference to a parameter
    and the get_attr inputs that alias it see the data again once :func:`fill_storage` runs.
    """
    tensor.data.untyped_storage().resize_(0)


def fill_storage(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Give a freed ``tensor`` its memory back, holding ``value`` (through ``.data``: no version bump)."""
    data = tensor.data
    data.untyped_storage().resize_(data.numel() * data.element_size())
    data.copy_(value)


def is_freed(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0
