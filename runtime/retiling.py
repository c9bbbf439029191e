"""Transfers between two spatial stages: each value re-tiled from the sender's tiles onto the receiver's.

Stage s sends value v as its output tiles (the grid of v in its spatial analysis); stage d > s
takes v as tiles of its own grid of v (runtime.tiles.input_grids). Every sending tile sends every
receiving tile the part of v their regions share (runtime.spatial.retile), one message each, and in
the backward the receiving tile sends that part of v's gradient back. A tile rank posts its pieces
value by value (the dataflow's order of the edge), then by receiving tile, then by sending tile,
so the pieces between two ranks match in posting order. The sending and receiving ranks are
always different (each spatial stage has its own slot). Not halo traffic: not counted in
``halo_bytes_sent``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from cost_models.halo import Region
from planner.schedules import Action, ActionKind
from runtime.comm import Message
from runtime.dataflow import Dataflow
from runtime.spatial.retile import assemble, crop, overlaps
from runtime.spatial.tiling import TileGrid
from runtime.tiles import TiledStage
from runtime.values import ValueSpec


@dataclass(frozen=True)
class Piece:
    """One region of one value that this rank sends to, or receives from, one rank of the other stage."""

    name: str
    region: Region
    peer_rank: int


@dataclass(frozen=True)
class Retiling:
    """One communication action between two spatial stages, as one of their tile ranks runs it.

    Example (a tile rank of stage 1 receiving stage 0's values for micro-batch 3)::

        retiling = Retiling.of(Action(1, ActionKind.RECV_F, 3, peer=0), flow, tiled, peer_ranks)
        messages = retiling.messages({}, flow.specs, device)     # empty buffers, one per piece
        ... exchange ...
        tiles = retiling.assemble(messages)                        # value name -> this rank's tile
    """

    action: Action
    tile: int  # this rank's tile of its stage
    grids: Mapping[str, TileGrid]  # this rank's grid of each value (output grid when sending stage)
    pieces: tuple[Piece, ...]  # in posting order

    @classmethod
    def of(cls, action: Action, flow: Dataflow, tiled: Mapping[int, TiledStage],
           peer_ranks: Sequence[int]) -> Retiling:
        """The pieces of ``action`` (on a rank of ``action.stage``) whose peer stage runs on ``peer_ranks``."""
        assert action.peer is not None
        on_sender = action.kind in (ActionKind.SEND_F, ActionKind.RECV_B)
        src, dst = (action.stage, action.peer) if on_sender else (action.peer, action.stage)
        forward = action.kind in (ActionKind.SEND_F, ActionKind.RECV_F)
        names = flow.travelling((src, dst)) if forward else flow.gradients((src, dst))
        sender, receiver = tiled[src], tiled[dst]
        mine = sender if on_sender else receiver
        assert mine.tile is not None, f"{action}: this rank holds no tile of stage {mine.stage}"
        pieces = []
        for name in names:
            for overlap in overlaps(sender.output_grids[name], receiver.input_grids[name]):
                own, peer = (overlap.sender, overlap.receiver) if on_sender else (overlap.receiver, overlap.sender)
                if own == mine.tile:
                    pieces.append(Piece(name, overlap.region, peer_ranks[peer]))
        grids = mine.output_grids if on_sender else mine.input_grids
        return cls(action, mine.tile, {name: grids[name] for name in names}, tuple(pieces))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.grids)

    def messages(self, tiles: Mapping[str, torch.Tensor], specs: Mapping[str, ValueSpec],
                 device: torch.device) -> list[Message]:
        """One message per piece: for a send, the piece cut out of this rank's tile of its value in
        ``tiles``; for a receive, an empty buffer of the piece's shape."""
        if self.action.kind.is_send:
            return [Message(self.action, piece.peer_rank,
                            [crop(tiles[piece.name].detach(), self.grids[piece.name], self.tile, piece.region)])
                    for piece in self.pieces]
        return [Message(self.action, piece.peer_rank, [torch.empty(
            (*specs[piece.name].shape[:-2], piece.region.height, piece.region.width),
            dtype=specs[piece.name].dtype, device=device)]) for piece in self.pieces]

    def assemble(self, messages: Sequence[Message]) -> dict[str, torch.Tensor]:
        """This rank's tile of every value (or of its gradient) from the received ``messages``."""
        received: dict[str, list[tuple[Region, torch.Tensor]]] = {name: [] for name in self.names}
        for piece, message in zip(self.pieces, messages, strict=True):
            received[piece.name].append((piece.region, message.tensors[0]))
        return {name: assemble(self.grids[name], self.tile, pieces) for name, pieces in received.items()}
