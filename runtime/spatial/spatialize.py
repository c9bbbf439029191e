"""Swap a module tree's conv, pool and batch-norm layers for their tiled, halo-exchanging versions."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch.distributed as dist
from torch import fx, nn

from cost_models.errors import SpatialError
from runtime.spatial.batchnorm import SpatialBatchNorm2d
from runtime.spatial.graph import Role, SpatialGraph, analyse, trace_spatial
from runtime.spatial.halo import DEFAULT_TIMEOUT
from runtime.spatial.layers import SpatialAvgPool2d, SpatialConv2d, SpatialMaxPool2d
from runtime.spatial.tiling import TileGrid


@dataclass(frozen=True)
class _Options:
    sync_bn: bool
    overlap: bool
    timeout: datetime.timedelta


def _sharing_copy(module: nn.Module) -> nn.Module:
    """A deep copy of the module tree that shares every parameter and buffer with the original."""
    memo = {id(tensor): tensor for tensor in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


def _replace(root: nn.Module, path: str, replacement: nn.Module) -> None:
    parent_path, _, attribute = path.rpartition(".")
    setattr(root.get_submodule(parent_path) if parent_path else root, attribute, replacement)


def _tiled_layer(module: nn.Module, name: str, grid: TileGrid, group: dist.ProcessGroup | None, tag: int,
                 options: _Options) -> nn.Module:
    """The spatial version of one conv, pool or batch-norm layer; other layers are returned as they are."""
    if type(module) is nn.BatchNorm2d:
        return SpatialBatchNorm2d.from_module(module, group, sync=options.sync_bn)
    overlap, timeout = options.overlap, options.timeout
    if isinstance(module, nn.Conv2d):
        return SpatialConv2d.from_module(module, grid, group, name=name, tag=tag, overlap=overlap, timeout=timeout)
    if isinstance(module, nn.MaxPool2d):
        return SpatialMaxPool2d.from_module(module, grid, group, name=name, tag=tag, overlap=overlap, timeout=timeout)
    if isinstance(module, nn.AvgPool2d):
        return SpatialAvgPool2d.from_module(module, grid, group, name=name, tag=tag, overlap=overlap, timeout=timeout)
    return module


def _input_grids(graph: SpatialGraph, keep: Collection[str]) -> dict[str, tuple[int, TileGrid]]:
    """Each conv/pool/batch-norm layer's input grid and a tag (its first call's index among them),
    the layers of the ``keep`` nodes left out; shared layers checked."""
    found: dict[str, tuple[int, TileGrid]] = {}
    layers = [node for node in graph.nodes if node.role in (Role.WINDOW, Role.BATCH_NORM)]
    kept = {node.layer: node.name for node in layers if node.name in keep}
    for tag, node in enumerate(layers):
        if node.name in keep:
            continue
        if node.layer in kept:
            raise SpatialError(f"layer {node.layer!r} is called by node {node.name!r} and by node "
                               f"{kept[node.layer]!r}, which is tiled apart (a fused group); give each call "
                               f"its own layer")
        grid = graph[node.inputs[0]].grid
        assert grid is not None
        if found.setdefault(node.layer, (tag, grid))[1] != grid:
            raise SpatialError(f"layer {node.layer!r} is called on tensors tiled differently; a shared layer "
                               f"must see the same tile grid every time (give each call its own layer)")
    return found


def spatialize(module: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None, *, sync_bn: bool = True,
               overlap: bool = True, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
               keep: Collection[str] = (), input_grids: Mapping[str, TileGrid] | None = None) -> nn.Module:
    """A copy of ``module`` that runs on tiles of ``grid``, every halo exchanged per layer.

    The copy shares parameters and buffers with ``module``; its Conv2d / MaxPool2d / AvgPool2d
    become SpatialConv2d / SpatialMaxPool2d / SpatialAvgPool2d bound to the tile grid they see
    (strided layers shrink it), its BatchNorm2d become SpatialBatchNorm2d (``sync_bn``). Every
    input of ``module`` is one tile of ``grid``; outputs are tiles of ``output_grid(module, grid)``.
    ``input_grids`` gives named inputs (placeholders) a grid of their own instead of ``grid``.
    Raises SpatialError naming the first layer that cannot be tiled exactly (global pooling,
    flatten, ceil_mode pools where they round up, non-zero padding modes, ...), before any communication.

    Layer k of the module's conv/pool/batch-norm calls (in trace order) exchanges its halos under
    tag k, so tags from the number of traced nodes on are free for other exchanges on ``group``.
    The layers of the nodes named in ``keep`` stay as they are: the caller tiles those nodes
    otherwise (runtime/spatial_stage.py fuses their halos). A GraphModule keeps its node names.

    Example::

        grid = TileGrid.build(4, "square", 256, 256)
        stem = spatialize(nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool), grid, group)
        y_tile = stem(grid.tile(x, dist.get_rank(group)))
    """
    options = _Options(sync_bn, overlap, timeout)
    graph = analyse(trace_spatial(module), grid, input_grids)
    if fx.Tracer().is_leaf_module(module, ""):  # a lone layer
        return _tiled_layer(module, type(module).__name__, grid, group, 0, options)
    tiled = _sharing_copy(module)
    for layer, (tag, input_grid) in _input_grids(graph, keep).items():
        _replace(tiled, layer, _tiled_layer(tiled.get_submodule(layer), layer, input_grid, group, tag, options))
    return tiled


def output_grid(module: nn.Module, grid: TileGrid) -> TileGrid:
    """The tile grid of a plain ``module``'s (first) output when its inputs are tiled by ``grid``."""
    out = analyse(trace_spatial(module), grid).output.grid
    assert out is not None
    return out
