"""Spatial parallelism: an image split into tiles over ranks, with exact halo exchange for conv and pool.

Output pixel o of a conv/pool belongs to the tile holding input pixel ``o*stride - padding +
dilation*(kernel-1)//2`` (its receptive field's centre); cost_models.halo documents the rule and
derives every halo from it, so forward outputs and all gradients equal the unpartitioned layers.

Public API::

    from runtime.spatial import TileGrid, spatialize, FusedHaloBlock, allreduce_replicated_grads
    grid = TileGrid.build(4, "square", 512, 512)           # or "vertical" / "horizontal" strips
    tiled = spatialize(stem, grid, group)                   # per-layer halos, synchronised batch-norm
    fused = FusedHaloBlock(stem, grid, group)               # one wide halo for the whole group
    y_tile = tiled(grid.tile(x, dist.get_rank(group)))
    y_tile.backward(grad_tile); allreduce_replicated_grads(tiled, group)
    full = gather_tiles(y_tile, output_grid(stem, grid), group)
"""

from runtime.spatial.batchnorm import SpatialBatchNorm2d, batch_norm_tiles
from runtime.spatial.fused import FusedHaloBlock, fuse_sequential
from runtime.spatial.grads import allreduce_replicated_grads
from runtime.spatial.halo import ExchangePlan, HaloExchange, MessageCounter, count_messages
from runtime.spatial.join import gather_tiles
from runtime.spatial.layers import SpatialAvgPool2d, SpatialConv2d, SpatialMaxPool2d
from runtime.spatial.spatialize import output_grid, spatialize
from runtime.spatial.tiling import Direction, Slicing, TileGrid

__all__ = [
    "Direction",
    "ExchangePlan",
    "FusedHaloBlock",
    "HaloExchange",
    "MessageCounter",
    "Slicing",
    "SpatialAvgPool2d",
    "SpatialBatchNorm2d",
    "SpatialConv2d",
    "SpatialMaxPool2d",
    "TileGrid",
    "allreduce_replicated_grads",
    "batch_norm_tiles",
    "count_messages",
    "fuse_sequential",
    "gather_tiles",
    "output_grid",
    "spatialize",
]
