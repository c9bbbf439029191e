"""Tile grids: how an NCHW image is cut into per-rank tiles, and splitting and joining tensors by them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from math import isqrt

import torch

from cost_models.errors import SpatialError
from cost_models.halo import Region, Window, balanced_edges, output_edges, tile_region

Edges = tuple[int, ...]


class Slicing(str, Enum):
    """How P ranks cut the image: a sqrt(P) x sqrt(P) grid, P column strips or P row strips."""

    SQUARE = "square"
    VERTICAL = "vertical"  # vertical cuts: 1 row of P tiles side by side
    HORIZONTAL = "horizontal"  # horizontal cuts: P tiles stacked top to bottom


class Direction(str, Enum):
    """Where a neighbouring tile lies, as (row step, column step)."""

    NORTH_WEST = "north-west"
    NORTH = "north"
    NORTH_EAST = "north-east"
    WEST = "west"
    EAST = "east"
    SOUTH_WEST = "south-west"
    SOUTH = "south"
    SOUTH_EAST = "south-east"

    @property
    def step(self) -> tuple[int, int]:
        return _STEPS[self]


_STEPS = {
    Direction.NORTH_WEST: (-1, -1), Direction.NORTH: (-1, 0), Direction.NORTH_EAST: (-1, 1),
    Direction.WEST: (0, -1), Direction.EAST: (0, 1),
    Direction.SOUTH_WEST: (1, -1), Direction.SOUTH: (1, 0), Direction.SOUTH_EAST: (1, 1),
}


def grid_shape(parts: int, slicing: Slicing | str) -> tuple[int, int]:
    """(rows, cols) of the tile grid for ``parts`` ranks; square needs a perfect square."""
    kind = Slicing(slicing)
    if parts < 1:
        raise SpatialError(f"a tile grid needs at least one rank, got parts={parts}")
    if kind is Slicing.VERTICAL:
        return 1, parts
    if kind is Slicing.HORIZONTAL:
        return parts, 1
    side = isqrt(parts)
    if side * side != parts:
        squares = ", ".join(str(n * n) for n in range(1, max(4, side + 2)))
        raise SpatialError(f"square slicing needs a square number of ranks, got {parts}; use one of "
                           f"{squares}, or vertical/horizontal strips")
    return side, side


def _even_edges(length: int, parts: int, what: str) -> Edges:
    if length % parts:
        below, above = length // parts * parts, (length // parts + 1) * parts
        nearby = ", ".join(str(n) for n in (below, above) if n >= parts)
        raise SpatialError(f"{what} {length} does not split evenly into {parts} tiles; sizes that do "
                           f"nearby: {nearby} (any multiple of {parts}); or pass even=False for tiles "
                           f"of {length // parts + 1} and {length // parts} pixels")
    return tuple(range(0, length + 1, length // parts))


def _edges(length: int, parts: int, even: bool, what: str) -> Edges:
    if length < parts:
        raise SpatialError(f"{what} {length} cannot be split into {parts} tiles; need {what} >= {parts} "
                           f"(one pixel per tile) or fewer ranks")
    return _even_edges(length, parts, what) if even else balanced_edges(length, parts)


@dataclass(frozen=True)
class TileGrid:
    """A ``rows x cols`` grid of tiles over an ``height x width`` image; rank r holds tile (r//cols, r%cols).

    Tile sizes may differ (by one pixel after a balanced split, by more after strided layers).

    Example:
        >>> grid = TileGrid.build(4, "square", 10, 9)
        >>> grid.row_edges, grid.col_edges
        ((0, 5, 10), (0, 5, 9))
        >>> grid.position(3), grid.tile_shape(3)
        ((1, 1), (5, 4))
    """

    rows: int
    cols: int
    slicing: Slicing
    height: int
    width: int
    row_edges: Edges
    col_edges: Edges

    def __post_init__(self) -> None:
        object.__setattr__(self, "slicing", Slicing(self.slicing))
        for edges, count, length, what in ((self.row_edges, self.rows, self.height, "row_edges"),
                                           (self.col_edges, self.cols, self.width, "col_edges")):
            steps_up = all(lo < hi for lo, hi in itertools.pairwise(edges))
            if len(edges) != count + 1 or edges[0] != 0 or edges[-1] != length or not steps_up:
                raise SpatialError(f"TileGrid: {what}={edges} must rise strictly from 0 to {length} "
                                   f"in {count} steps")

    @classmethod
    def build(cls, parts: int, slicing: Slicing | str, height: int, width: int, *,
              even: bool = False) -> TileGrid:
        """The grid for ``parts`` ranks; uneven sizes get tiles differing by one pixel, or an error if ``even``."""
        rows, cols = grid_shape(parts, slicing)
        return cls(rows, cols, Slicing(slicing), height, width,
                   _edges(height, rows, even, "height"), _edges(width, cols, even, "width"))

    @property
    def parts(self) -> int:
        return self.rows * self.cols

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.parts:
            raise SpatialError(f"rank {rank} is not in a {self.rows}x{self.cols} tile grid "
                               f"(ranks 0..{self.parts - 1})")

    def position(self, rank: int) -> tuple[int, int]:
        """(row, col) of rank's tile."""
        self._check_rank(rank)
        return divmod(rank, self.cols)

    def rank_at(self, row: int, col: int) -> int:
        """The rank holding tile (row, col)."""
        return row * self.cols + col

    def region(self, rank: int) -> Region:
        """The image pixels rank owns."""
        self._check_rank(rank)
        return tile_region(self, rank)

    def row_range(self, rank: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of rank's tile."""
        region = self.region(rank)
        return region.row_lo, region.row_hi

    def col_range(self, rank: int) -> tuple[int, int]:
        """Columns ``[lo, hi)`` of rank's tile."""
        region = self.region(rank)
        return region.col_lo, region.col_hi

    def tile_shape(self, rank: int) -> tuple[int, int]:
        """(height, width) of rank's tile."""
        region = self.region(rank)
        return region.height, region.width

    @property
    def image(self) -> Region:
        return Region(0, self.height, 0, self.width)

    def neighbours(self, rank: int) -> dict[Direction, int]:
        """The up-to-8 ranks whose tiles touch rank's tile, by direction."""
        row, col = self.position(rank)
        found = {}
        for direction in Direction:
            next_row, next_col = row + direction.step[0], col + direction.step[1]
            if 0 <= next_row < self.rows and 0 <= next_col < self.cols:
                found[direction] = self.rank_at(next_row, next_col)
        return found

    def after(self, row_window: Window, col_window: Window, *, layer: str = "layer") -> TileGrid:
        """The grid of a window layer's output under the ownership rule of cost_models.halo."""
        row_edges = output_edges(self.row_edges, row_window, layer=layer)
        col_edges = output_edges(self.col_edges, col_window, layer=layer)
        return TileGrid(self.rows, self.cols, self.slicing, row_edges[-1], col_edges[-1], row_edges, col_edges)

    def tile(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's tile of a full ``(..., H, W)`` tensor (a view)."""
        self._check_image(tensor)
        rows, cols = self.region(rank).offsets_in(self.image)
        return tensor[..., rows, cols]

    def split(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every rank's tile of a full tensor, by rank (views)."""
        return tuple(self.tile(tensor, rank) for rank in range(self.parts))

    def join(self, tiles: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's tile, by rank (inverse of ``split``)."""
        if len(tiles) != self.parts:
            raise SpatialError(f"join needs {self.parts} tiles for a {self.rows}x{self.cols} grid, got {len(tiles)}")
        for rank, tile in enumerate(tiles):
            if tuple(tile.shape[-2:]) != self.tile_shape(rank):
                raise SpatialError(f"tile of rank {rank} has shape {tuple(tile.shape[-2:])}, the grid "
                                   f"expects {self.tile_shape(rank)}")
        bands = [torch.cat(list(tiles[row * self.cols:(row + 1) * self.cols]), dim=-1) for row in range(self.rows)]
        return torch.cat(bands, dim=-2)

    def _check_image(self, tensor: torch.Tensor) -> None:
        if tensor.dim() < 2 or tuple(tensor.shape[-2:]) != (self.height, self.width):
            raise SpatialError(f"tensor of shape {tuple(tensor.shape)} does not match the grid's "
                               f"{self.height}x{self.width} image")
