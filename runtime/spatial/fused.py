"""Fused halos (now-dl "design 2"): one wide halo exchange before a group of layers, none inside it.

Walking the group's graph backwards from each rank's output tile gives the region every tensor
must cover on that rank: a window layer widens its output region to the inputs it reads
(``input_span`` of cost_models.halo: stride, padding and dilation exactly, the now-dl rule
h_in = s*h_out + d*(k-1)/2 summed back over the group being the symmetric special case);
element-wise layers, adds and channel concats pass the region through; and every region also
covers the rank's own tile, so each activation's owner computes it (batch-norm statistics count
owned pixels only, once). The group's inputs exchange their widest region once; inside, each
layer crops what it reads (skip paths included) and pads only at the true image border, so the
result and the gradients equal the per-layer version, with fewer messages and some redundant
compute at the tile borders.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from cost_models.errors import SpatialError
from cost_models.halo import GroupNode, Region, WindowPair, group_needed_regions
from runtime.spatial.batchnorm import batch_norm_tiles
from runtime.spatial.graph import Role, SpatialGraph, SpatialNode, analyse, trace_spatial
from runtime.spatial.halo import DEFAULT_TIMEOUT, ExchangePlan, HaloExchange
from runtime.spatial.tiling import TileGrid
from runtime.spatial.window import compute_region

Located = tuple[torch.Tensor, Region]  # a tensor and the image region it covers


def needed_regions(graph: SpatialGraph, rank: int) -> dict[str, Region]:
    """For one rank, the region every node's output must cover so the group's output tile is exact
    (cost_models.halo.group_needed_regions over the group's nodes, the planner's walk too)."""
    nodes = [GroupNode(node.name, node.inputs, _windows(node))
             for node in graph.nodes if node.role is not Role.OUTPUT]
    return group_needed_regions(nodes, graph.output.inputs, lambda name: _own(graph[name], rank),
                                lambda name: _grid(graph[name]).image)


def _windows(node: SpatialNode) -> WindowPair | None:
    if node.role is not Role.WINDOW:
        return None
    assert node.spec is not None
    return node.spec.rows, node.spec.cols


def _grid(node: SpatialNode) -> TileGrid:
    assert node.grid is not None, f"{node.name} has no tile grid"
    return node.grid


def _own(node: SpatialNode, rank: int) -> Region:
    return _grid(node).region(rank)


def _last_readers(graph: SpatialGraph) -> dict[str, tuple[str, ...]]:
    """For each node, the values it is the last (non-output) reader of."""
    last: dict[str, str] = {}
    for node in graph.nodes:
        for name in node.inputs:
            last[name] = node.name
    readers: dict[str, list[str]] = {}
    for name, reader in last.items():
        if graph[reader].role is not Role.OUTPUT:
            readers.setdefault(reader, []).append(name)
    return {reader: tuple(names) for reader, names in readers.items()}


def _crop(located: Located, region: Region) -> torch.Tensor:
    tensor, covers = located
    return tensor[(..., *region.offsets_in(covers))]


class FusedHaloBlock(nn.Module):
    """Run ``module`` on tiles with one halo exchange per input, before its first layer.

    ``module`` may be any fx-traceable group of Conv2d / MaxPool2d / AvgPool2d / BatchNorm2d,
    element-wise activations, adds and channel concats: a Sequential, a residual block with a
    skip path, a multi-branch cell with several inputs. Parameters are ``module``'s own. Batch
    norm uses image-wide statistics when ``sync_bn``. ``tag`` numbers this block's exchanges (one
    per input, ``tag``, ``tag + 1``, ...) and must match on every rank.

    Example::

        block = FusedHaloBlock(resnet.layer1, grid, group)     # 1 exchange instead of 3
        y_tile = block(x_tile)                                  # a tile of block.output_grid
        count_messages(block).forward_messages
    """

    def __init__(self, module: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None, *,
                 sync_bn: bool = True, tag: int = 0, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        graph = analyse(trace_spatial(module), grid)
        if dist.get_world_size(group) != grid.parts:
            raise SpatialError(f"{type(module).__name__}: the tile grid has {grid.parts} tiles but the process "
                               f"group has {dist.get_world_size(group)} ranks; build the grid with that many parts")
        rank = dist.get_rank(group)
        every_rank = [needed_regions(graph, peer) for peer in range(grid.parts)]
        self.module, self.group, self.sync_bn, self.rank = module, group, sync_bn, rank
        self.input_grid, self.output_grid = grid, _grid(graph.output)
        self._graph, self._needed = graph, every_rank[rank]
        self._fx_nodes = {node.name: node for node in graph.module.graph.nodes}
        self._last_read_by = _last_readers(graph)
        self._exchanges = {
            node.name: HaloExchange(ExchangePlan.build(grid, [needed[node.name] for needed in every_rank], rank),
                                    group, tag=tag + index, timeout=timeout)
            for index, node in enumerate(graph.inputs)}

    @property
    def halo_exchanges(self) -> tuple[HaloExchange, ...]:
        return tuple(self._exchanges.values())

    @property
    def halo_regions(self) -> dict[str, Region]:
        """The region each input's exchange fills on this rank (own tile plus the wide halo)."""
        return {name: exchange.plan.needed for name, exchange in self._exchanges.items()}

    def forward(self, *tiles: torch.Tensor) -> Any:
        inputs = self._graph.inputs
        if len(tiles) != len(inputs):
            raise SpatialError(f"{type(self.module).__name__} takes {len(inputs)} tiles, got {len(tiles)}")
        values: dict[str, Located] = {}
        feed = iter(tiles)
        for node in self._graph.nodes:
            if node.role is Role.OUTPUT:
                return self._outputs(node, values)
            if node.role is Role.INPUT:
                values[node.name] = self._exchange(node, next(feed))
            else:
                values[node.name] = (self._run(node, values), self._needed[node.name])
            for name in self._last_read_by.get(node.name, ()):
                del values[name]  # nothing reads it any more: let autograd alone decide what to keep
        raise AssertionError("graph without output")

    def _exchange(self, node: SpatialNode, tile: torch.Tensor) -> Located:
        exchange = self._exchanges[node.name]
        if not exchange.plan.has_messages:
            exchange.check_tile(tile)
            return tile, exchange.plan.own
        return exchange.exchange(tile), exchange.plan.needed

    def _run(self, node: SpatialNode, values: dict[str, Located]) -> torch.Tensor:
        need = self._needed[node.name]
        fx_node = self._fx_nodes[node.name]
        if node.role is Role.WINDOW:
            assert node.spec is not None
            source = self._graph[node.inputs[0]]
            tensor, covers = values[source.name]
            module = self._graph.module.get_submodule(node.layer)
            return compute_region(module, node.spec, tensor, covers, need, _grid(source).image)
        if node.role is Role.BATCH_NORM:
            owned = _own(node, self.rank).offsets_in(need)
            bn = self._graph.module.get_submodule(node.layer)
            return batch_norm_tiles(_crop(values[node.inputs[0]], need), bn, self.group,  # type: ignore[arg-type]
                                    sync=self.sync_bn, owned=owned)
        args, kwargs = fx.node.map_arg((fx_node.args, fx_node.kwargs), lambda arg: _crop(values[arg.name], need))
        return self._call(fx_node, args, kwargs)

    def _call(self, fx_node: fx.Node, args: Any, kwargs: Any) -> torch.Tensor:
        if fx_node.op == "call_module":
            return self._graph.module.get_submodule(str(fx_node.target))(*args, **kwargs)
        if fx_node.op == "call_method":
            return getattr(args[0], str(fx_node.target))(*args[1:], **kwargs)
        return fx_node.target(*args, **kwargs)  # type: ignore[operator]

    def _outputs(self, node: SpatialNode, values: dict[str, Located]) -> Any:
        fx_node = self._fx_nodes[node.name]
        return fx.node.map_arg(fx_node.args[0], lambda arg: _crop(values[arg.name], _own(self._graph[arg.name],
                                                                                         self.rank)))


def fuse_sequential(sequential: nn.Sequential, grid: TileGrid, group: dist.ProcessGroup | None,
                    sizes: Sequence[int], *, sync_bn: bool = True) -> nn.Sequential:
    """Cut a Sequential into consecutive groups of ``sizes`` children, each one FusedHaloBlock.

    Example: ``fuse_sequential(stem, grid, group, [4, 1])`` fuses the first four layers and the
    fifth separately (two halo exchanges).
    """
    children = list(sequential.children())
    if sum(sizes) != len(children) or min(sizes, default=0) < 1:
        raise SpatialError(f"fuse_sequential: group sizes {list(sizes)} must be positive and add up to the "
                           f"{len(children)} layers of the Sequential")
    blocks, start = [], 0
    for index, size in enumerate(sizes):
        block = FusedHaloBlock(nn.Sequential(*children[start:start + size]), grid, group, sync_bn=sync_bn,
                               tag=1000 * index)
        blocks.append(block)
        grid, start = block.output_grid, start + size
    return nn.Sequential(*blocks)
