"""cost_models.halo: hand-computed halo bytes, messages and times, fused chains, the tile join, errors."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from cost_models.comm import halo_message_count
from cost_models.devices import LinkSpec
from cost_models.errors import SpatialError
from cost_models.graph.ir import Geometry
from cost_models.halo import Window, balanced_edges, chain_halo_cost, halo_cost, tile_join_cost

# 10 GB/s and 5 us: alpha = 0.005 ms, 1e-7 ms per byte.
LINK = LinkSpec("test link", bandwidth_gb_per_s=10.0, latency_us=5.0)
ALPHA_MS, MS_PER_BYTE = 0.005, 1e-7


@dataclass(frozen=True)
class Grid:
    """A tile grid as the planner can describe one without the runtime: just the edges."""

    row_edges: tuple[int, ...]
    col_edges: tuple[int, ...]


def conv(kernel: int, stride: int = 1, padding: int = 0, dilation: int = 1) -> Geometry:
    return Geometry("conv", (kernel, kernel), (stride, stride), (padding, padding), (dilation, dilation))


def test_3x3_conv_on_two_strips_sends_one_column_each_way() -> None:
    grid = Grid((0, 8), (0, 4, 8))
    for rank, peer in ((0, 1), (1, 0)):
        cost = halo_cost(conv(3, padding=1), grid, rank, channels=4, dtype_bytes=4, batch=1, link=LINK)
        assert cost.send_bytes == ((peer, 8 * 4 * 4),) and cost.recv_bytes == ((peer, 128),)
        assert cost.messages == 1 and cost.bytes_sent == 128
        assert cost.exchange_ms == pytest.approx(ALPHA_MS + 128 * MS_PER_BYTE)


def test_3x3_conv_on_a_square_grid_sends_edges_and_a_corner() -> None:
    grid = Grid((0, 4, 8), (0, 4, 8))
    pixel = 2 * 8 * 3  # channels x float64 x batch
    cost = halo_cost(conv(3, padding=1), grid, 0, channels=2, dtype_bytes=8, batch=3, link=LINK)
    assert cost.send_bytes == ((1, 4 * pixel), (2, 4 * pixel), (3, 1 * pixel))
    assert cost.messages == 3 == halo_message_count([n for _, n in cost.send_bytes])
    assert cost.exchange_ms == pytest.approx(3 * ALPHA_MS + 9 * pixel * MS_PER_BYTE)


def test_1x1_conv_exchanges_nothing() -> None:
    grid = Grid((0, 4, 8), (0, 4, 8))
    for stride in (1, 2):
        cost = halo_cost(conv(1, stride=stride), grid, 3, channels=64, dtype_bytes=4, batch=8, link=LINK)
        assert cost.send_bytes == () and cost.recv_bytes == () and cost.exchange_ms == 0.0


def test_strided_halos_can_be_one_sided() -> None:
    """3x3/2 on columns [0, 4) | [4, 8): rank 1's outputs 2, 3 read columns 3..7, rank 0's read -1..3."""
    grid = Grid((0, 8), (0, 4, 8))
    left = halo_cost(conv(3, stride=2, padding=1), grid, 0, channels=1, dtype_bytes=4, batch=1, link=LINK)
    right = halo_cost(conv(3, stride=2, padding=1), grid, 1, channels=1, dtype_bytes=4, batch=1, link=LINK)
    assert (left.send_bytes, left.recv_bytes, left.messages) == (((1, 32),), (), 1)
    assert (right.send_bytes, right.recv_bytes, right.messages) == ((), ((0, 32),), 0)
    assert left.exchange_ms == right.exchange_ms == pytest.approx(ALPHA_MS + 32 * MS_PER_BYTE)


def test_2x2_pool_on_an_odd_width_reads_one_column_from_the_right() -> None:
    grid = Grid((0, 6), balanced_edges(9, 2))  # columns [0, 5) | [5, 9)
    pool = Geometry("max_pool", (2, 2), (2, 2), (0, 0), (1, 1))
    assert halo_cost(pool, grid, 0, channels=1, dtype_bytes=4, batch=1, link=LINK).recv_bytes == ((1, 24),)
    assert halo_cost(pool, grid, 1, channels=1, dtype_bytes=4, batch=1, link=LINK).send_bytes == ((0, 24),)


def test_a_fused_chain_sends_one_wide_message_instead_of_one_per_layer() -> None:
    grid = Grid((0, 8), (0, 4, 8))
    chain = [conv(3, padding=1)] * 3
    fused = chain_halo_cost(chain, grid, 0, channels=1, dtype_bytes=4, batch=1, link=LINK)
    assert fused.send_bytes == ((1, 3 * 8 * 4),)  # three columns at once
    per_layer = [halo_cost(g, grid, 0, channels=1, dtype_bytes=4, batch=1, link=LINK) for g in chain]
    assert sum(c.messages for c in per_layer) == 3 and fused.messages == 1
    assert sum(c.exchange_ms for c in per_layer) - fused.exchange_ms == pytest.approx(2 * ALPHA_MS)


def test_a_fused_chain_through_a_stride_uses_the_exact_receptive_field() -> None:
    """3x3/2 then 3x3: rank 1 owns outputs [2, 4), which read layer-1 outputs [1, 4) + own [2, 4), so
    inputs [1, 8): three columns [1, 4) from rank 0 (now-dl's 2*1 + 1 = 3)."""
    grid = Grid((0, 8), (0, 4, 8))
    cost = chain_halo_cost([conv(3, 2, 1), conv(3, padding=1)], grid, 1, channels=1, dtype_bytes=1, batch=1, link=LINK)
    assert cost.recv_bytes == ((0, 3 * 8),)


def test_tile_join_gathers_every_other_tile() -> None:
    join = tile_join_cost(Grid((0, 4, 8), (0, 4, 8)), channels=2, dtype_bytes=8, batch=3, link=LINK)
    assert (join.dst, join.bytes_received, join.messages) == (0, 3 * 16 * 48, 3)
    assert join.join_ms == pytest.approx(3 * ALPHA_MS + 2304 * MS_PER_BYTE)
    uneven = tile_join_cost(Grid((0, 2), balanced_edges(10, 3)), channels=1, dtype_bytes=1, batch=1, link=LINK, dst=1)
    assert (uneven.bytes_received, uneven.messages) == (2 * 4 + 2 * 3, 2)


@pytest.mark.parametrize(("geometry", "message"), [
    (Geometry("conv_transpose", (2, 2), (2, 2), (0, 0), (1, 1)), r"layer 'up': a conv_transpose layer cannot"),
    (Geometry("conv", (3, 3), (1, 1), (1, 1), (1, 1), padding_mode="reflect"), r"'up': padding_mode='reflect'"),
    (Geometry("max_pool", (3, 3), (2, 2), (0, 0), (1, 1), ceil_mode=True), r"'up': ceil_mode=True rounds up at input size \(8, 8\)"),
    (Geometry("conv", (3,), (1,), (1,), (1,)), r"'up': only 2-d windows"),
])
def test_untileable_geometries_are_named(geometry: Geometry, message: str) -> None:
    with pytest.raises(SpatialError, match=message):
        halo_cost(geometry, Grid((0, 8), (0, 4, 8)), 0, channels=1, dtype_bytes=4, batch=1, link=LINK, layer="up")


def test_a_ceil_mode_pool_tiles_where_it_rounds_as_floor_mode() -> None:
    """PyTorch's ceil mode by hand: 2x2 stride 2 over 7 pixels gives 4 outputs (floor 3), over 8 gives 4
    (floor 4); 3x3 stride 2 padding 1 gives 4 over 7 either way, and 5 over 8 (floor 4)."""
    two, three = Window(2, 2, 0, 1), Window(3, 2, 1, 1)
    assert (two.ceil_output_length(7), two.output_length(7), two.ceil_output_length(8)) == (4, 3, 4)
    assert (three.ceil_output_length(7), three.output_length(7), three.ceil_output_length(8)) == (4, 4, 5)
    pool = Geometry("max_pool", (2, 2), (2, 2), (0, 0), (1, 1), ceil_mode=True)
    assert halo_cost(pool, Grid((0, 8), (0, 4, 8)), 0, channels=1, dtype_bytes=4, batch=1, link=LINK).send_bytes == ()
    with pytest.raises(SpatialError, match=r"rounds up at input size \(7, 8\)"):
        halo_cost(pool, Grid((0, 7), (0, 4, 8)), 0, channels=1, dtype_bytes=4, batch=1, link=LINK)


def test_counts_must_be_positive() -> None:
    with pytest.raises(SpatialError, match=r"channels=0, dtype_bytes=4 and batch=1 must all be >= 1"):
        halo_cost(conv(3, padding=1), Grid((0, 8), (0, 4, 8)), 0, channels=0, dtype_bytes=4, batch=1, link=LINK)


def test_the_cost_model_imports_no_torch() -> None:
    code = "import sys, cost_models.halo; assert 'torch' not in sys.modules and 'runtime' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
