"""Re-tiling: an image held as the tiles of one grid moved onto the tiles of another grid of the same image.

Between two consecutive spatial stages a value leaves as tiles of the sending stage's grid (the
grid its analysis gives the value) and arrives as tiles of the receiving stage's grid (balanced
over the value's own height and width, with its own count and slicing). Every pair (sending tile,
receiving tile) whose regions intersect moves exactly that intersection; a grid's tiles partition
the image, so the intersections of one tile with the other grid's tiles partition that tile and
every pixel moves once. The backward moves the gradient of each intersection the other way.
Overlaps are ordered by receiving tile, then sending tile: the order both sides post them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cost_models.errors import SpatialError
from cost_models.halo import Region
from runtime.spatial.tiling import TileGrid


@dataclass(frozen=True)
class Overlap:
    """The image pixels that sending tile ``sender`` holds and receiving tile ``receiver`` needs."""

    sender: int  # tile of the sending grid
    receiver: int  # tile of the receiving grid
    region: Region  # in image pixels, never empty


def overlaps(sending: TileGrid, receiving: TileGrid) -> tuple[Overlap, ...]:
    """Every non-empty intersection of a sending tile with a receiving tile, by receiving tile then sending tile.

    Example: 2x2 square tiles of a 4x4 image onto 2 vertical strips: each strip takes a column of
    two square tiles whole.

        >>> [(o.sender, o.receiver) for o in overlaps(TileGrid.build(4, "square", 4, 4),
        ...                                           TileGrid.build(2, "vertical", 4, 4))]
        [(0, 0), (2, 0), (1, 1), (3, 1)]
    """
    if (sending.height, sending.width) != (receiving.height, receiving.width):
        raise SpatialError(f"cannot re-tile a {sending.height}x{sending.width} image onto a grid of a "
                           f"{receiving.height}x{receiving.width} image; both grids must cover the same image")
    found = []
    for receiver in range(receiving.parts):
        for sender in range(sending.parts):
            region = sending.region(sender).intersect(receiving.region(receiver))
            if not region.is_empty:
                found.append(Overlap(sender, receiver, region))
    return tuple(found)


def crop(tile: torch.Tensor, grid: TileGrid, index: int, region: Region) -> torch.Tensor:
    """The part of tile ``index`` of ``grid`` (a ``(..., h, w)`` tensor) covering ``region``, contiguous."""
    own = grid.region(index)
    if tuple(tile.shape[-2:]) != (own.height, own.width) or not own.contains(region):
        raise SpatialError(f"tile {index} of shape {tuple(tile.shape[-2:])} over {own} cannot give {region}; "
                           f"the grid expects a {own.height}x{own.width} tile containing the region")
    return tile[(..., *region.offsets_in(own))].contiguous()


def assemble(grid: TileGrid, index: int, pieces: Sequence[tuple[Region, torch.Tensor]]) -> torch.Tensor:
    """Tile ``index`` of ``grid`` put together from ``pieces`` (region, tensor) that partition it."""
    own = grid.region(index)
    covered = sum(region.area for region, _ in pieces)
    if not pieces or covered != own.area or not all(own.contains(region) for region, _ in pieces):
        raise SpatialError(f"pieces {[region for region, _ in pieces]} do not partition tile {index} {own} "
                           f"({covered} of its {own.area} pixels)")
    first = pieces[0][1]
    tile = first.new_empty((*first.shape[:-2], own.height, own.width))
    for region, piece in pieces:
        tile[(..., *region.offsets_in(own))] = piece
    return tile
