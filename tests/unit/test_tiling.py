"""Tile grids, the output ownership rule, interiors, and computing any output region of a window layer."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from cost_models.halo import (
    Region,
    Window,
    balanced_edges,
    chain_needed_regions,
    halo_transfers,
    layer_needed_regions,
    needed_region,
)
from cost_models.errors import SpatialError
from runtime.spatial.layers import interior_region
from runtime.spatial.tiling import Direction, Slicing, TileGrid, grid_shape
from runtime.spatial.window import compute_region, window_spec


@pytest.mark.parametrize(("parts", "slicing", "shape"), [
    (4, "square", (2, 2)), (9, "square", (3, 3)), (1, "square", (1, 1)),
    (3, "vertical", (1, 3)), (3, "horizontal", (3, 1)), (6, Slicing.VERTICAL, (1, 6)),
])
def test_grid_shapes(parts: int, slicing: str, shape: tuple[int, int]) -> None:
    assert grid_shape(parts, slicing) == shape


def test_square_slicing_needs_a_square_number_and_lists_them() -> None:
    with pytest.raises(SpatialError, match=r"square number of ranks, got 6; use one of 1, 4, 9"):
        grid_shape(6, "square")


def test_uneven_splits_differ_by_at_most_one_pixel() -> None:
    grid = TileGrid.build(4, "vertical", 10, 10)
    assert grid.col_edges == (0, 3, 6, 8, 10)
    for length, parts in itertools.product(range(1, 40), range(1, 9)):
        if length >= parts:
            edges = balanced_edges(length, parts)
            sizes = [hi - lo for lo, hi in itertools.pairwise(edges)]
            assert sum(sizes) == length and max(sizes) - min(sizes) <= 1, (length, parts, sizes)


def test_even_splits_reject_uneven_sizes_and_say_which_work() -> None:
    with pytest.raises(SpatialError, match=r"height 10 does not split evenly into 4 tiles; sizes that do nearby: "
                                           r"8, 12 .*even=False for tiles of 3 and 2 pixels"):
        TileGrid.build(4, "horizontal", 10, 7, even=True)
    assert TileGrid.build(4, "square", 12, 6, even=True).row_edges == (0, 6, 12)


def test_too_few_pixels_for_the_tiles() -> None:
    with pytest.raises(SpatialError, match=r"width 3 cannot be split into 4 tiles; need width >= 4"):
        TileGrid.build(4, "vertical", 8, 3)


def test_grid_checks_its_edges() -> None:
    with pytest.raises(SpatialError, match=r"row_edges=\(0, 5, 5, 10\) must rise strictly from 0 to 10"):
        TileGrid(3, 1, "horizontal", 10, 4, (0, 5, 5, 10), (0, 4))


def test_positions_regions_and_ranks() -> None:
    grid = TileGrid.build(9, "square", 10, 11)
    assert grid.row_edges == (0, 4, 7, 10) and grid.col_edges == (0, 4, 8, 11)
    for rank in range(9):
        assert grid.rank_at(*grid.position(rank)) == rank
    assert grid.position(5) == (1, 2)
    assert grid.region(5) == Region(4, 7, 8, 11)
    assert grid.row_range(5) == (4, 7) and grid.col_range(5) == (8, 11) and grid.tile_shape(5) == (3, 3)
    with pytest.raises(SpatialError, match=r"rank 9 is not in a 3x3 tile grid"):
        grid.region(9)


def test_neighbours_corners_edges_and_centre() -> None:
    grid = TileGrid.build(9, "square", 9, 9)
    assert grid.neighbours(0) == {Direction.EAST: 1, Direction.SOUTH: 3, Direction.SOUTH_EAST: 4}
    assert len(grid.neighbours(1)) == 5
    assert grid.neighbours(4) == {Direction.NORTH_WEST: 0, Direction.NORTH: 1, Direction.NORTH_EAST: 2,
                                  Direction.WEST: 3, Direction.EAST: 5, Direction.SOUTH_WEST: 6,
                                  Direction.SOUTH: 7, Direction.SOUTH_EAST: 8}
    strips = TileGrid.build(4, "horizontal", 9, 9)
    assert strips.neighbours(0) == {Direction.SOUTH: 1}
    assert strips.neighbours(2) == {Direction.NORTH: 1, Direction.SOUTH: 3}
    assert TileGrid.build(1, "square", 4, 4).neighbours(0) == {}


@pytest.mark.parametrize("slicing", ["square", "vertical", "horizontal"])
def test_split_and_join_round_trip_on_uneven_tiles(slicing: str) -> None:
    grid = TileGrid.build(4, slicing, 11, 14)
    x = torch.randn(2, 3, 11, 14)
    tiles = grid.split(x)
    assert [tuple(t.shape[-2:]) for t in tiles] == [grid.tile_shape(rank) for rank in range(4)]
    assert torch.equal(grid.join(tiles), x)
    with pytest.raises(SpatialError, match=r"join needs 4 tiles"):
        grid.join(tiles[:3])
    with pytest.raises(SpatialError, match=r"does not match the grid's 11x14 image"):
        grid.tile(torch.zeros(1, 1, 11, 13), 0)


def _owner_count(window: Window, length: int, edge: int) -> int:
    """Brute force: outputs whose anchor, clamped into the image, lies before ``edge``."""
    outputs = window.output_length(length)
    anchors = [min(max(o * window.stride - window.padding + window.anchor_offset, 0), length - 1)
               for o in range(outputs)]
    return sum(1 for anchor in anchors if anchor < edge)


def test_output_edges_follow_the_anchor_ownership_rule() -> None:
    for kernel, stride, padding, dilation in itertools.product(range(1, 6), range(1, 4), range(4), (1, 2)):
        window = Window(kernel, stride, padding, dilation)
        for length in range(max(1, window.span - 2 * padding), 16):
            for edge in range(length + 1):
                expected = window.output_length(length) if edge == length else _owner_count(window, length, edge)
                assert window.output_edge(edge, length) == expected, (window, length, edge)


def test_strided_layers_shrink_the_grid_rounding_up() -> None:
    grid = TileGrid.build(4, "square", 225, 224)
    stem = window_spec(nn.Conv2d(3, 8, 7, stride=2, padding=3), "conv1")
    after = grid.after(stem.rows, stem.cols)
    assert (after.height, after.width) == (113, 112)
    assert after.row_edges == (0, 57, 113) and after.col_edges == (0, 56, 112)


def _reads(window: Window, output: int, length: int) -> range:
    lo, hi = window.input_span(output, output + 1)
    return range(max(lo, 0), min(hi, length))


def test_interior_holds_exactly_the_outputs_that_read_only_own_pixels() -> None:
    rng = random.Random(0)
    for _ in range(300):
        layer = nn.Conv2d(1, 1, rng.randint(1, 6), stride=rng.randint(1, 3), padding=rng.randint(0, 3),
                          dilation=rng.randint(1, 2))
        spec = window_spec(layer, "conv")
        height = width = rng.randint(spec.rows.span, 30)
        if height + 2 * layer.padding[0] < spec.rows.span:
            continue
        try:
            grid = TileGrid.build(rng.choice([2, 3]), "horizontal", height, width)
            out_grid = grid.after(spec.rows, spec.cols)
        except SpatialError:
            continue
        for rank in range(grid.parts):
            own, out = grid.region(rank), out_grid.region(rank)
            inner = interior_region(spec, out, own, grid.image)
            for row in range(out.row_lo, out.row_hi):
                only_own = all(own.row_lo <= pixel < own.row_hi for pixel in _reads(spec.rows, row, height))
                assert only_own == (inner.row_lo <= row < inner.row_hi), (layer, grid.row_edges, rank, row)


WINDOW_LAYERS = [
    nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(2, 3, 5, stride=2, padding=1, dilation=2),
    nn.Conv2d(2, 4, (1, 7), padding=(0, 3), groups=2), nn.Conv2d(2, 3, 3, padding=2),
    nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(3, 1, 1, dilation=2), nn.AvgPool2d(3, 1, 1, count_include_pad=False),
    nn.AvgPool2d(3, 2, 1), nn.AvgPool2d(5, 2, 2, divisor_override=3),
]


@pytest.mark.parametrize("layer", WINDOW_LAYERS, ids=[repr(layer) for layer in WINDOW_LAYERS])
def test_compute_region_equals_the_slice_of_the_full_output(layer: nn.Module) -> None:
    rng = random.Random(1)
    layer = layer.double()
    spec = window_spec(layer, "layer")
    x = torch.randn(2, 2, 13, 12, dtype=torch.float64)
    full = layer(x)
    image = Region(0, 13, 0, 12)
    for _ in range(25):
        rows = sorted(rng.sample(range(full.shape[-2] + 1), 2))
        cols = sorted(rng.sample(range(full.shape[-1] + 1), 2))
        out = Region(rows[0], rows[1], cols[0], cols[1])
        needed = needed_region((spec.rows, spec.cols), out, image)
        held = needed.hull(Region(max(0, needed.row_lo - 1), needed.row_hi, needed.col_lo, needed.col_hi))
        piece = compute_region(layer, spec, x[(..., *held.offsets_in(image))], held, out, image)
        torch.testing.assert_close(piece, full[(..., *out.offsets_in(Region(0, 99, 0, 99)))], rtol=1e-12, atol=1e-12)


def test_transfers_are_symmetric_and_cover_every_needed_pixel() -> None:
    grid = TileGrid.build(9, "square", 20, 17)
    spec = window_spec(nn.Conv2d(1, 1, 5, stride=2, padding=2), "conv")
    needed = layer_needed_regions(grid, (spec.rows, spec.cols))
    for rank in range(9):
        sends, receives = halo_transfers(grid, needed, rank)
        for peer, region in receives:
            assert (rank, region) in halo_transfers(grid, needed, peer)[0]
        covered = grid.region(rank).intersect(needed[rank]).area + sum(region.area for _, region in receives)
        assert covered == needed[rank].area
        assert len(sends) <= len(grid.neighbours(rank))


def test_wide_halos_reach_past_the_neighbouring_tile() -> None:
    grid = TileGrid.build(4, "vertical", 8, 10)  # strips 3, 3, 2, 2 wide
    spec = window_spec(nn.Conv2d(1, 1, 7, padding=6, dilation=2), "wide")
    _, receives = halo_transfers(grid, layer_needed_regions(grid, (spec.rows, spec.cols)), 0)
    assert [peer for peer, _ in receives] == [1, 2, 3]  # a 6-pixel halo spans three narrow strips


def test_a_fused_chain_needs_its_whole_receptive_field_and_the_own_tile() -> None:
    grid = TileGrid.build(2, "vertical", 16, 16)
    conv3 = (Window(3, 1, 1), Window(3, 1, 1))
    one_by_one_stride_2 = (Window(1, 2, 0), Window(1, 2, 0))
    assert chain_needed_regions(grid, [conv3, conv3, conv3])[1] == Region(0, 16, 5, 16)
    # a 1x1 stride-2 layer reads even columns only, but its input region still covers the own tile
    assert chain_needed_regions(grid, [one_by_one_stride_2])[0] == Region(0, 16, 0, 8)
