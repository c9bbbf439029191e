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
import time
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

    def pack(self, index: int, full: torch.Tensor, into: torch.Tensor) -> None:
        """``full`` as :meth:`padded` gives it, written into ``into`` (``(world, chunk_numel)``, a collective
        table's columns) without a padded copy."""
        flat, chunk = full.reshape(-1), self.chunk_numel(index)
        if not chunk:
            return
        whole_rows, rest = divmod(flat.numel(), chunk)
        into[:whole_rows].copy_(flat[:whole_rows * chunk].view(whole_rows, chunk))
        if whole_rows < self.world:
            into[whole_rows, :rest].copy_(flat[whole_rows * chunk:])
            into[whole_rows, rest:].zero_()
            into[whole_rows + 1:].zero_()

    def chunk(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``full`` (a new tensor, flat)."""
        return self.padded(index, full)[self.rank].clone()

    def unpad(self, index: int, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The parameter from its ``(world, chunk_numel)`` chunks."""
        return rows.reshape(-1)[:self.numels[index]].view(shape)


class ShardGroup:
    """The collectives of one stage's ZeRO group, each waited for with the executor's timeout.

    Their buffers are new tensors, freed with their last reference (as FSDP2's are): ZeRO-3's layer groups hold
    nothing between collectives but their shards, and on a GPU the caching allocator hands the same blocks back
    to the next collective or to activations. Two things keep the CPU meter (runtime/memory.py) true on gloo,
    whose worker threads run the collectives where the meter does not see what they free:

    * a collective's buffers are given back by this thread: after each wait, until gloo's worker has dropped its
      references to them (:func:`_settle`, a moment), so that the last reference, and the free, is the caller's;
    * a layer group's gradient sum (``in_place``) is an all-reduce of a table the group keeps, in place, this
      rank's row then read from it (twice the bytes on the wire, costed so: planner/search/terms.py). gloo's
      reduce-scatter copies its input into a temporary of its own, which its worker thread often frees (a step of
      hundreds of them measured up to 20% above what it held); its in-place all-reduce allocates nothing, but a
      new table given to it was still, once in about twenty sums, freed on that thread after :func:`_settle`.
      The kept table (grown to the largest group's gradients) is one copy more that a CPU rank holds
      (cost_models.comm.KEPT_SUM_TABLE).
    """

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._gloo = dist.get_backend(group) == "gloo"  # (see above)
        self._table: torch.Tensor | None = None  # gloo's kept table of in-place sums

    def _kept_table(self, row_numel: int, like: torch.Tensor) -> torch.Tensor:
        """A ``(world, row_numel)`` view of the kept table, grown if it is smaller (a new one if the dtype
        differs)."""
        kept = self._table
        if kept is None or kept.dtype != like.dtype or kept.numel() < self.world * row_numel:
            kept = self._table = like.new_empty(self.world * row_numel)
        return kept[:self.world * row_numel].view(self.world, row_numel)

    def kept_tensors(self) -> list[torch.Tensor]:
        """What the group holds between collectives (gloo's kept table)."""
        return [] if self._table is None else [self._table]

    def layout(self, numels: Sequence[int]) -> ShardLayout:
        return ShardLayout(tuple(numels), self.world, self.rank)

    def all_gather(self, layout: ShardLayout, chunks: Sequence[torch.Tensor], label: str, *,
                   device: torch.device | None = None) -> list[torch.Tensor]:
        """Every rank's chunks -> each parameter's ``(world, chunk_numel)`` rows (padding kept), on ``device``
        (default the chunks'; chunks on the host are copied up first: ZeRO-Infinity's parameters on the host)."""
        return self.start_all_gather(layout, chunks, label, device=device).finish()

    def start_all_gather(self, layout: ShardLayout, chunks: Sequence[torch.Tensor], label: str, *,
                         device: torch.device | None = None) -> PendingGather:
        """:meth:`all_gather` started, its rows taken by :meth:`PendingGather.finish` (so that it runs while
        others start and finish: ZeRO-3's prefetch)."""
        flat = [chunk.reshape(-1) for chunk in chunks]
        row = flat[0].new_empty(layout.row_numel, device=device)
        if all(chunk.device == row.device for chunk in flat):
            torch.cat(flat, out=row)
        else:
            start = 0
            for chunk in flat:
                row[start:start + chunk.numel()].copy_(chunk, non_blocking=True)  # (pinned host chunks)
                start += chunk.numel()
        rows = row.new_empty(self.world * row.numel())
        table = rows.view(self.world, -1)  # (before the counts: a view holds its base)
        buffers = (row, rows) if self._gloo else ()
        counts = tuple(buffer._use_count() for buffer in buffers)
        work = dist.all_gather_single(rows, row, group=self.group, async_op=True)
        return PendingGather(work, table, layout, self.timeout, f"the {label} all-gather", buffers, counts)

    def reduce_scatter(self, layout: ShardLayout, fulls: list[torch.Tensor], label: str, *,
                       in_place: bool = False) -> list[torch.Tensor]:
        """Sum ``fulls`` over the group; this rank keeps its chunk of each sum (flat views of one tensor, valid
        until the next ``in_place`` sum).
        ``fulls`` is emptied once packed into the collective's table: the caller's whole tensors (gradients)
        are freed before the sum runs, if it keeps no other reference. ``in_place``: on gloo, the sum is an
        all-reduce of the group's kept table in place (see the class)."""
        sums_in_place = in_place and self._gloo
        table = self._kept_table(layout.row_numel, fulls[0]) if sums_in_place else fulls[0].new_empty(
            self.world, layout.row_numel)
        for (index, full), start in zip(enumerate(fulls), _offsets(layout)):
            layout.pack(index, full, table[:, start:start + layout.chunk_numel(index)])
        fulls.clear()
        if sums_in_place:
            wait_for(dist.all_reduce(table, group=self.group, async_op=True), self.timeout, f"the {label} sum")
            mine = table[self.rank]
        else:
            mine, flat = table.new_empty(layout.row_numel), table.view(-1)  # (before the counts, as above)
            buffers = (mine, flat) if self._gloo else ()
            counts = tuple(buffer._use_count() for buffer in buffers)
            work = dist.reduce_scatter_single(mine, flat, group=self.group, async_op=True)
            wait_for(work, self.timeout, f"the {label} reduce-scatter")
            del work
            _settle(buffers, counts)
        return [mine[start:start + layout.chunk_numel(index)] for index, start in enumerate(_offsets(layout))]


class PendingGather:
    """An all-gather started (:meth:`ShardGroup.start_all_gather`), its rows valid once :meth:`finish` returns."""

    def __init__(self, work: dist.Work, table: torch.Tensor, layout: ShardLayout, timeout: datetime.timedelta,
                 label: str, buffers: Sequence[torch.Tensor] = (), counts: Sequence[int] = ()) -> None:
        """``buffers``: the tensors to :func:`_settle` after the wait (gloo's), whose use counts were ``counts``
        before the collective started."""
        self.work: dist.Work | None = work
        self.table = table
        self.layout = layout
        self.timeout = timeout
        self.label = label
        self._settling = (tuple(buffers), tuple(counts))

    def finish(self) -> list[torch.Tensor]:
        """Wait for it (once): each parameter's ``(world, chunk_numel)`` rows (views of its buffer)."""
        if self.work is not None:
            wait_for(self.work, self.timeout, self.label)
            self.work = None
            _settle(*self._settling)
            self._settling = ((), ())
        offsets = _offsets(self.layout)
        return [self.table[:, start:start + self.layout.chunk_numel(index)] for index, start in enumerate(offsets)]


def _settle(buffers: Sequence[torch.Tensor], counts: Sequence[int], limit_s: float = 0.02) -> None:
    """Wait until nothing but what held ``buffers`` before their collective holds them (each back at its use count
    in ``counts``): gloo's worker thread drops its references to a collective's tensors a moment after the wait
    returns, and when it drops the last, the memory is freed on that thread, which the CPU meter does not see.
    Bounded by ``limit_s`` (a slower release only misleads the meter)."""
    deadline = time.monotonic() + limit_s
    while any(buffer._use_count() > count for buffer, count in zip(buffers, counts)) and time.monotonic() < deadline:
        time.sleep(0)


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
