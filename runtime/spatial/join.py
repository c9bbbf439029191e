"""The tile join: gathering every rank's tile of an image into the full tensor."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cost_models.errors import SpatialError
from runtime.spatial.tiling import TileGrid


def gather_tiles(tile: torch.Tensor, grid: TileGrid, group: dist.ProcessGroup | None,
                 dst: int | None = None) -> torch.Tensor | None:
    """Join the tiles of ``grid`` held by the ranks of ``group`` into the full ``(N, C, H, W)`` tensor.

    With ``dst=None`` every rank gets the full tensor; otherwise only group rank ``dst`` does and the
    others get None. Tiles are padded to the largest tile shape for the collective. Not
    differentiable (the join of a training step is the first non-spatial stage's receive).

    Example::

        full = gather_tiles(out_tile, layer.output_grid, group)   # same on every rank
    """
    rank = dist.get_rank(group)
    if tuple(tile.shape[-2:]) != grid.tile_shape(rank):
        raise SpatialError(f"gather_tiles: rank {rank} holds a tile of shape {tuple(tile.shape[-2:])}, the "
                           f"grid expects {grid.tile_shape(rank)}")
    tallest = max(grid.tile_shape(peer)[0] for peer in range(grid.parts))
    widest = max(grid.tile_shape(peer)[1] for peer in range(grid.parts))
    padded = F.pad(tile.detach(), (0, widest - tile.shape[-1], 0, tallest - tile.shape[-2])).contiguous()
    buffers = [torch.empty_like(padded) for _ in range(grid.parts)]
    if dst is None:
        dist.all_gather(buffers, padded, group=group)
    else:
        dist.gather(padded, buffers if rank == dst else None, group_dst=dst, group=group)
        if rank != dst:
            return None
    tiles = [buffer[..., :h, :w] for buffer, (h, w) in
             zip(buffers, (grid.tile_shape(peer) for peer in range(grid.parts)))]
    return grid.join(tiles)
