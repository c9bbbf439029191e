"""Tile-aware Conv2d, MaxPool2d and AvgPool2d that exchange exactly the halo they read, per layer.

Each layer takes this rank's tile of its input (the ``input_grid`` tile) and returns this rank's
tile of its output (the ``output_grid`` tile, ownership rule in cost_models.halo). While the
halo is in flight the tile's interior (outputs that read only its own pixels or the image's
padding) is computed; the border strips follow once the halo has arrived. On CUDA the halo is
packed on a side stream; on CPU the same code runs with a null stream.
"""

from __future__ import annotations

import datetime
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from cost_models.errors import SpatialError
from cost_models.halo import Region, Window, layer_needed_regions
from runtime.spatial.halo import DEFAULT_TIMEOUT, ExchangePlan, HaloExchange
from runtime.spatial.tiling import TileGrid
from runtime.spatial.window import WindowSpec, compute_region, window_spec


def _interior(window: Window, out_lo: int, out_hi: int, own_lo: int, own_hi: int, length: int) -> tuple[int, int]:
    """Outputs in ``[out_lo, out_hi)`` whose in-image inputs all lie in ``[own_lo, own_hi)``."""
    first = out_lo if own_lo == 0 else max(out_lo, -((-(own_lo + window.padding)) // window.stride))
    last = out_hi if own_hi == length else min(out_hi, (own_hi - window.span + window.padding) // window.stride + 1)
    return first, max(first, last)


def interior_region(spec: WindowSpec, out: Region, own: Region, image: Region) -> Region:
    """The outputs a rank can compute from its own tile alone, before its halo arrives."""
    rows = _interior(spec.rows, out.row_lo, out.row_hi, own.row_lo, own.row_hi, image.height)
    cols = _interior(spec.cols, out.col_lo, out.col_hi, own.col_lo, own.col_hi, image.width)
    return Region(*rows, *cols)


def border_regions(out: Region, inner: Region) -> tuple[Region, Region, Region, Region]:
    """The strips of ``out`` around ``inner``: top and bottom (full width), left and right."""
    return (Region(out.row_lo, inner.row_lo, out.col_lo, out.col_hi),
            Region(inner.row_hi, out.row_hi, out.col_lo, out.col_hi),
            Region(inner.row_lo, inner.row_hi, out.col_lo, inner.col_lo),
            Region(inner.row_lo, inner.row_hi, inner.col_hi, out.col_hi))


class SpatialWindowLayer(nn.Module):
    """Shared machinery of the tiled conv and pools: the exchange, the regions, and the forward."""

    spec: WindowSpec
    input_grid: TileGrid
    output_grid: TileGrid
    exchange: HaloExchange
    overlap: bool
    layer_name: str

    def _bind(self, spec: WindowSpec, grid: TileGrid, group: dist.ProcessGroup | None, name: str,
              tag: int, overlap: bool, timeout: datetime.timedelta) -> None:
        size = dist.get_world_size(group)
        if size != grid.parts:
            raise SpatialError(f"layer {name!r}: the tile grid has {grid.parts} tiles but the process group "
                               f"has {size} ranks; build the grid with parts={size}")
        rank = dist.get_rank(group)
        self.spec, self.input_grid, self.layer_name, self.overlap = spec, grid, name, overlap
        self.output_grid = grid.after(spec.rows, spec.cols, layer=name)
        needed = layer_needed_regions(grid, (spec.rows, spec.cols), layer=name)
        self.exchange = HaloExchange(ExchangePlan.build(grid, needed, rank), group, tag=tag, timeout=timeout)
        out = self.output_grid.region(rank)
        self._out = out
        self._inner = interior_region(spec, out, grid.region(rank), grid.image)

    @property
    def halo_exchanges(self) -> tuple[HaloExchange, ...]:
        return (self.exchange,)

    def forward(self, tile: torch.Tensor) -> torch.Tensor:
        plan, image = self.exchange.plan, self.input_grid.image
        if tile.dim() != 4 or tuple(tile.shape[-2:]) != (plan.own.height, plan.own.width):
            raise SpatialError(f"layer {self.layer_name!r} on rank {plan.rank} expects an (N, C, {plan.own.height}, "
                               f"{plan.own.width}) tile of the {self.input_grid.height}x{self.input_grid.width} "
                               f"image, got {tuple(tile.shape)}")
        if not plan.has_messages:
            return compute_region(self, self.spec, tile, plan.own, self._out, image)
        tile, flight = self.exchange.start(tile)
        if not self.overlap or self._inner.is_empty:
            slab = self.exchange.finish(tile, flight)
            return compute_region(self, self.spec, slab, plan.needed, self._out, image)
        inner = compute_region(self, self.spec, tile, plan.own, self._inner, image)
        slab = self.exchange.finish(tile, flight)
        top, bottom, left, right = (compute_region(self, self.spec, slab, plan.needed, strip, image)
                                    if not strip.is_empty else None
                                    for strip in border_regions(self._out, self._inner))
        middle = torch.cat([part for part in (left, inner, right) if part is not None], dim=-1)
        return torch.cat([part for part in (top, middle, bottom) if part is not None], dim=-2)

    def extra_repr(self) -> str:
        grid = self.input_grid
        return (f"{self.layer_name!r}, {self.spec.kind.value}, rows={self.spec.rows}, cols={self.spec.cols}, "
                f"grid={grid.rows}x{grid.cols} over {grid.height}x{grid.width}, overlap={self.overlap}")


class SpatialConv2d(SpatialWindowLayer):
    """A Conv2d over tiles, sharing the weight and bias of the convolution it replaces.

    Example::

        grid = TileGrid.build(4, "square", 224, 224)
        conv = SpatialConv2d.from_module(model.conv1, grid, group)   # same weight and bias objects
        y_tile = conv(grid.tile(x, rank))        # == conv.output_grid.tile(model.conv1(x), rank)
    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    groups: int

    @classmethod
    def from_module(cls, conv: nn.Conv2d, grid: TileGrid, group: dist.ProcessGroup | None, *,
                    name: str = "conv", tag: int = 0, overlap: bool = True,
                    timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> SpatialConv2d:
        """Tile ``conv`` over ``grid``; ``name`` appears in errors, ``tag`` must match on every rank."""
        spec = window_spec(conv, name)
        layer = cls()
        layer.weight = cast(nn.Parameter, conv.weight)
        layer.bias = cast("nn.Parameter | None", conv.bias)
        layer.groups = conv.groups
        layer._bind(spec, grid, group, name, tag, overlap, timeout)
        return layer


class SpatialMaxPool2d(SpatialWindowLayer):
    """A MaxPool2d over tiles; padding beyond the image is -inf, as in PyTorch's max pooling.

    Example: ``pool = SpatialMaxPool2d.from_module(model.maxpool, conv.output_grid, group)``.
    """

    @classmethod
    def from_module(cls, pool: nn.MaxPool2d, grid: TileGrid, group: dist.ProcessGroup | None, *,
                    name: str = "max_pool", tag: int = 0, overlap: bool = True,
                    timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> SpatialMaxPool2d:
        """Tile ``pool`` over ``grid`` (return_indices is rejected, ceil_mode where it rounds up at this size)."""
        spec = window_spec(pool, name)
        spec.check_size(grid.height, grid.width, name)
        layer = cls()
        layer._bind(spec, grid, group, name, tag, overlap, timeout)
        return layer


class SpatialAvgPool2d(SpatialWindowLayer):
    """An AvgPool2d over tiles; count_include_pad and divisor_override behave as in PyTorch.

    Example: ``pool = SpatialAvgPool2d.from_module(nn.AvgPool2d(3, 1, 1), grid, group)``.
    """

    count_include_pad: bool
    divisor_override: int | None

    @classmethod
    def from_module(cls, pool: nn.AvgPool2d, grid: TileGrid, group: dist.ProcessGroup | None, *,
                    name: str = "avg_pool", tag: int = 0, overlap: bool = True,
                    timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> SpatialAvgPool2d:
        """Tile ``pool`` over ``grid`` (ceil_mode is rejected where it rounds up at this size)."""
        spec = window_spec(pool, name)
        spec.check_size(grid.height, grid.width, name)
        layer = cls()
        layer.count_include_pad, layer.divisor_override = pool.count_include_pad, pool.divisor_override
        layer._bind(spec, grid, group, name, tag, overlap, timeout)
        return layer
