"""Halo exchange between tiles: one batched point-to-point round, differentiable, with message counters.

Each rank holds its own tile and needs a (usually larger) region of the image; the exchange plan
lists what it sends to and receives from every peer (cost_models.halo.halo_transfers). The forward
pass posts every send and receive in one ``dist.batch_isend_irecv`` (so no ordering of peers can
deadlock) and waits with a timeout; the backward pass sends each received halo's gradient back to
its owner, which adds it to its own input gradient, so input gradients are exact.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cost_models.errors import SpatialError
from cost_models.halo import Region, halo_transfers
from runtime.spatial.tiling import TileGrid
from runtime.streams import AnyStream, Event, current_stream, keep_alive, new_stream, use_stream

Transfer = tuple[int, Region]
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class ExchangePlan:
    """What one rank holds after an exchange (``needed``) and the pieces it sends and receives."""

    rank: int
    own: Region
    needed: Region
    sends: tuple[Transfer, ...]
    receives: tuple[Transfer, ...]

    @classmethod
    def build(cls, grid: TileGrid, needed_by_rank: Sequence[Region], rank: int) -> ExchangePlan:
        """The plan for ``rank`` given every rank's needed region (each clamped to the image)."""
        sends, receives = halo_transfers(grid, needed_by_rank, rank)
        return cls(rank, grid.region(rank), needed_by_rank[rank], sends, receives)

    @property
    def has_messages(self) -> bool:
        return bool(self.sends or self.receives)

    @property
    def kept(self) -> Region:
        """The part of the rank's own tile that it keeps (the rest nobody on this rank reads)."""
        return self.own.intersect(self.needed)


@dataclass
class MessageCounter:
    """Messages and bytes this rank has sent through one exchange, forward and backward."""

    forward_messages: int = 0
    forward_bytes: int = 0
    backward_messages: int = 0
    backward_bytes: int = 0

    def add(self, other: MessageCounter) -> MessageCounter:
        return MessageCounter(self.forward_messages + other.forward_messages,
                              self.forward_bytes + other.forward_bytes,
                              self.backward_messages + other.backward_messages,
                              self.backward_bytes + other.backward_bytes)


@dataclass
class Flight:
    """One forward and backward round of an exchange: what is posted and not yet waited for."""

    works: list[dist.Work]
    received: dict[int, torch.Tensor]
    ready: Event
    sent: list[torch.Tensor]
    backward_works: list[dist.Work] | None = None
    incoming: dict[int, torch.Tensor] = field(default_factory=dict)


def _slices(region: Region, outer: Region) -> tuple[slice, slice, slice, slice]:
    rows, cols = region.offsets_in(outer)
    return slice(None), slice(None), rows, cols


def _shape(like: torch.Tensor, region: Region) -> tuple[int, int, int, int]:
    return like.shape[0], like.shape[1], region.height, region.width


class HaloExchange:
    """One halo exchange of a tiled layer (or fused group) on a process group.

    ``exchange(tile)`` returns the ``plan.needed`` region as a tensor, differentiable with respect
    to the tile. ``start``/``finish`` split it so the caller can compute the tile's interior while
    the halo is in flight: ``start`` returns the tile to compute from (the same values; its
    backward collects the halo gradients the peers send back) and the flight to finish.
    ``tag`` keeps the exchanges of different layers apart on the wire; it must be the same on
    every rank for the same layer, and different for layers whose backward passes may interleave.

    Example::

        plan = ExchangePlan.build(grid, needed_by_rank, dist.get_rank(group))
        halo = HaloExchange(plan, group, tag=3)
        slab = halo.exchange(tile)            # covers plan.needed, halo included
        tile, flight = halo.start(tile)       # or: overlap the interior with the transfer
        inner = layer_interior(tile)
        slab = halo.finish(tile, flight)
        halo.counter.forward_messages         # messages this rank sent so far
    """

    def __init__(self, plan: ExchangePlan, group: dist.ProcessGroup | None, *, tag: int = 0,
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        self.plan = plan
        self.group = group
        self.tag = tag
        self.timeout = timeout
        self.counter = MessageCounter()
        self._side_streams: dict[torch.device, AnyStream] = {}

    def exchange(self, tile: torch.Tensor) -> torch.Tensor:
        """The needed region around ``tile``, halo included (blocking)."""
        return self.finish(*self.start(tile))

    def start(self, tile: torch.Tensor) -> tuple[torch.Tensor, Flight]:
        """Post every send and receive of the forward exchange; returns the tile to compute from."""
        self.check_tile(tile)
        flight = self.post_forward(tile)
        return _HaloStart.apply(tile, self, flight), flight

    def finish(self, tile: torch.Tensor, flight: Flight) -> torch.Tensor:
        """Wait for a started exchange and assemble the needed region (differentiable)."""
        return _HaloFinish.apply(tile, self, flight)

    def post_forward(self, tile: torch.Tensor) -> Flight:
        """Pack the pieces peers need on a side stream and post the batch of sends and receives."""
        side = self._side_stream(tile.device)
        side.wait_stream(current_stream(tile.device))
        with use_stream(side), torch.no_grad():
            sent = [tile[_slices(region, self.plan.own)].contiguous() for _, region in self.plan.sends]
            received = {peer: tile.new_empty(_shape(tile, region)) for peer, region in self.plan.receives}
            works = self._post(zip((peer for peer, _ in self.plan.sends), sent), received.items(), self.tag * 2)
        self.counter.forward_messages += len(sent)
        self.counter.forward_bytes += sum(t.numel() * t.element_size() for t in sent)
        return Flight(works, received, side.record_event(), sent)

    def assemble(self, tile: torch.Tensor, flight: Flight) -> torch.Tensor:
        """Wait for the forward round and write the kept tile and the received halos into one tensor."""
        self._wait(flight.works)
        current = current_stream(tile.device)
        current.wait_event(flight.ready)
        if not self.plan.receives and self.plan.kept == self.plan.own:
            return tile  # nothing arrives: the tile itself is the needed region
        needed = self.plan.needed
        slab = tile.new_empty(_shape(tile, needed))
        slab[_slices(self.plan.kept, needed)] = tile[_slices(self.plan.kept, self.plan.own)]
        for peer, region in self.plan.receives:
            keep_alive(flight.received[peer], current)
            slab[_slices(region, needed)] = flight.received[peer]
        flight.received, flight.sent = {}, []  # done with the buffers; the flight lives until backward
        return slab

    def post_backward(self, grad_slab: torch.Tensor, flight: Flight) -> torch.Tensor:
        """Send each received halo's gradient back to its owner; returns the kept part's gradient."""
        needed, own = self.plan.needed, self.plan.own
        outgoing = [(peer, grad_slab[_slices(region, needed)].contiguous()) for peer, region in self.plan.receives]
        flight.incoming = {peer: grad_slab.new_empty(_shape(grad_slab, region)) for peer, region in self.plan.sends}
        flight.backward_works = self._post(outgoing, flight.incoming.items(), self.tag * 2 + 1)
        self.counter.backward_messages += len(outgoing)
        self.counter.backward_bytes += sum(t.numel() * t.element_size() for _, t in outgoing)
        grad_tile = grad_slab.new_zeros(_shape(grad_slab, own))
        grad_tile[_slices(self.plan.kept, own)] = grad_slab[_slices(self.plan.kept, needed)]
        return grad_tile

    def collect_backward(self, grad_tile: torch.Tensor, flight: Flight) -> torch.Tensor:
        """Add the halo gradients the peers sent back to this rank's tile gradient."""
        if flight.backward_works is None:  # the assembled region fed nothing: send zero gradients
            self.post_backward(grad_tile.new_zeros(_shape(grad_tile, self.plan.needed)), flight)
        self._wait(flight.backward_works or [])
        grad_tile = grad_tile.clone()
        for peer, region in self.plan.sends:
            grad_tile[_slices(region, self.plan.own)] += flight.incoming[peer]
        flight.incoming = {}
        return grad_tile

    def _wait(self, works: Sequence[dist.Work]) -> None:
        for work in works:
            work.wait(self.timeout)

    def _post(self, sends: Iterable[tuple[int, torch.Tensor]], receives: Iterable[tuple[int, torch.Tensor]],
              tag: int) -> list[dist.Work]:
        ops = [dist.P2POp(dist.isend, tensor, self._global(peer), self.group, tag) for peer, tensor in sends]
        ops += [dist.P2POp(dist.irecv, tensor, self._global(peer), self.group, tag) for peer, tensor in receives]
        return dist.batch_isend_irecv(ops) if ops else []

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _side_stream(self, device: torch.device) -> AnyStream:
        if device not in self._side_streams:
            self._side_streams[device] = new_stream(device)
        return self._side_streams[device]

    def check_tile(self, tile: torch.Tensor) -> None:
        """SpatialError unless ``tile`` is an (N, C, H, W) tensor of this rank's tile size."""
        own = self.plan.own
        if tile.dim() != 4 or tuple(tile.shape[-2:]) != (own.height, own.width):
            raise SpatialError(f"halo exchange on rank {self.plan.rank} expects an (N, C, {own.height}, "
                               f"{own.width}) tile, got {tuple(tile.shape)}")


class _HaloStart(torch.autograd.Function):
    """Forward: pass the posted tile through. Backward: add the halo gradients the peers return."""

    @staticmethod
    def forward(ctx: Any, tile: torch.Tensor, exchange: HaloExchange,  # type: ignore[override]
                flight: Flight) -> torch.Tensor:
        ctx.exchange, ctx.flight = exchange, flight
        return tile

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_tile: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return ctx.exchange.collect_backward(grad_tile, ctx.flight), None, None


class _HaloFinish(torch.autograd.Function):
    """Forward: wait and assemble the needed region. Backward: post the halo gradients to their owners."""

    @staticmethod
    def forward(ctx: Any, tile: torch.Tensor, exchange: HaloExchange,  # type: ignore[override]
                flight: Flight) -> torch.Tensor:
        ctx.exchange, ctx.flight = exchange, flight
        return exchange.assemble(tile, flight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_slab: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return ctx.exchange.post_backward(grad_slab.contiguous(), ctx.flight), None, None


def count_messages(module: nn.Module) -> MessageCounter:
    """Messages and bytes sent by every halo exchange inside ``module`` (spatial layers, fused blocks).

    Example: ``count_messages(spatial_model).forward_messages``.
    """
    total = MessageCounter()
    for child in module.modules():
        for exchange in getattr(child, "halo_exchanges", ()):
            total = total.add(exchange.counter)
    return total
