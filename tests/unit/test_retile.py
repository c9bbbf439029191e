"""Re-tiling between two tile grids of one image: the overlaps against a hand count, and the pieces
put back together equal the receiving grid's tiles cut from the whole image."""

from __future__ import annotations

import pytest
import torch

from cost_models.errors import SpatialError
from cost_models.halo import Region
from runtime.spatial.retile import Overlap, assemble, crop, overlaps
from runtime.spatial.tiling import TileGrid


def test_square_tiles_onto_three_strips_match_a_hand_count() -> None:
    # 5x5 image: 2x2 square tiles cut rows and columns at 3; 3 vertical strips cut columns at 2 and 4
    square, strips = TileGrid.build(4, "square", 5, 5), TileGrid.build(3, "vertical", 5, 5)
    assert (square.row_edges, square.col_edges, strips.col_edges) == ((0, 3, 5), (0, 3, 5), (0, 2, 4, 5))
    assert overlaps(square, strips) == (
        Overlap(0, 0, Region(0, 3, 0, 2)), Overlap(2, 0, Region(3, 5, 0, 2)),  # strip 0: the left tiles
        Overlap(0, 1, Region(0, 3, 2, 3)), Overlap(1, 1, Region(0, 3, 3, 4)),  # strip 1 straddles the cut
        Overlap(2, 1, Region(3, 5, 2, 3)), Overlap(3, 1, Region(3, 5, 3, 4)),
        Overlap(1, 2, Region(0, 3, 4, 5)), Overlap(3, 2, Region(3, 5, 4, 5)))  # strip 2: the right tiles


def test_the_same_grid_keeps_every_tile_in_place() -> None:
    grid = TileGrid.build(2, "horizontal", 7, 4)
    assert overlaps(grid, grid) == (Overlap(0, 0, grid.region(0)), Overlap(1, 1, grid.region(1)))


@pytest.mark.parametrize(("sending", "receiving"), [
    (TileGrid.build(4, "square", 16, 16), TileGrid.build(2, "vertical", 16, 16)),
    (TileGrid.build(9, "square", 7, 11), TileGrid.build(2, "horizontal", 7, 11)),
    (TileGrid.build(3, "vertical", 8, 9), TileGrid.build(4, "square", 8, 9)),
    (TileGrid.build(2, "horizontal", 5, 5), TileGrid.build(5, "vertical", 5, 5)),
])
def test_pieces_put_together_are_the_receiving_tiles(sending: TileGrid, receiving: TileGrid) -> None:
    image = torch.randn(2, 3, sending.height, sending.width, dtype=torch.float64)
    held = sending.split(image)
    found = overlaps(sending, receiving)
    assert sum(overlap.region.area for overlap in found) == sending.height * sending.width  # each pixel once
    for tile in range(receiving.parts):
        pieces = [(o.region, crop(held[o.sender], sending, o.sender, o.region)) for o in found if o.receiver == tile]
        assert torch.equal(assemble(receiving, tile, pieces), receiving.tile(image, tile))


def test_grids_of_different_images_and_missing_pieces_are_refused() -> None:
    with pytest.raises(SpatialError, match=r"re-tile a 16x16 image onto a grid of a 8x8 image"):
        overlaps(TileGrid.build(2, "vertical", 16, 16), TileGrid.build(2, "vertical", 8, 8))
    grid = TileGrid.build(2, "vertical", 4, 4)
    with pytest.raises(SpatialError, match=r"do not partition tile 0 .* \(4 of its 8 pixels\)"):
        assemble(grid, 0, [(Region(0, 2, 0, 2), torch.zeros(1, 2, 2))])
    with pytest.raises(SpatialError, match=r"tile 1 of shape \(4, 2\) .* cannot give"):
        crop(torch.zeros(1, 4, 2), grid, 1, Region(0, 4, 0, 2))
