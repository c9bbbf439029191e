"""What the leading nodes of a convolutional graph cost on P image tiles (a spatial stage).

A spatial stage runs a leading run of the graph's nodes on ``rows x cols`` tiles of its input image,
one per rank; every tile rank computes its share of each node, exchanges halos before every
convolution and pooling layer, and synchronises batch-norm statistics (runtime/spatial). This
module gives, per node of that run, what the slowest tile spends and holds, and the halo bytes
each tile sends: the planner's spatial terms (planner/search/problem.py) are sums of these.

The tile grids follow the runtime's: the input is cut by cost_models.halo.balanced_edges, and every
window layer's output grid is cost_models.halo.output_edges of its input's, so the predicted halo
bytes are the bytes the runtime sends. Per node (``share`` = the largest tile's share of the node's
output image):

    fwd_ms  = fwd_ms x share + halo exchange (window layers) + statistics all-reduce (batch-norm)
    bwd_ms  = bwd_ms x share + the same exchange of halo gradients + the same all-reduce
    saved   = saved x share, plus for a batch-norm its centred and normalised tile (two outputs' worth),
              plus for a window layer its input tile padded with the halo it received
              (a new tensor the layer saves for its backward, where one process saves its input in place);
              for the input image, its tile (held from a micro-batch's forward to its backward)

The exchange overlapping interior compute (as the runtime's blocks do) is not credited: a bound.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from cost_models.comm import halo_exchange_ms
from cost_models.device_spec import LinkSpec
from cost_models.errors import SpatialError
from cost_models.estimation import CostTable
from cost_models.graph.ir import LayerGraph, LayerNode, NodeKind
from cost_models.halo import (
    Region,
    balanced_edges,
    halo_transfers,
    layer_needed_regions,
    output_edges,
    tile_region,
    windows_of,
)

Edges = tuple[int, ...]


@dataclass(frozen=True)
class Grid:
    """A tile grid by its edges (cost_models.halo.TileEdges)."""

    row_edges: Edges
    col_edges: Edges

    @property
    def parts(self) -> int:
        return (len(self.row_edges) - 1) * (len(self.col_edges) - 1)

    @functools.cached_property
    def largest_share(self) -> float:
        """The largest tile's share of the image."""
        area = self.row_edges[-1] * self.col_edges[-1]
        return max(tile_region(self, rank).area for rank in range(self.parts)) / area


@dataclass(frozen=True)
class NodeTiles:
    """One node of the tileable run on its tile grid: the largest tile's share of its output and, for a
    window layer, the halo pixels each tile sends and receives (per neighbour, in peer order)."""

    name: str
    share: float
    sent_pixels: tuple[tuple[int, ...], ...] = ()  # per tile rank, per neighbour
    received_pixels: tuple[tuple[int, ...], ...] = ()
    pixel_source: str = ""  # the node whose output the halo is cut from (its pixels' bytes)
    source_pixels: int = 1  # that output's height x width
    reads_image: bool = False  # the node reads the graph's input image (no gradient flows back to it)
    stats_bytes: int = 0  # a batch-norm's statistics (mean and variance per channel), all-reduced over the tiles


@dataclass(frozen=True)
class TileGeometry:
    """The graph's tileable leading run on a ``rows x cols`` grid of its ``height x width`` input."""

    rows: int
    cols: int
    height: int
    width: int
    nodes: tuple[NodeTiles, ...]  # the leading run of nodes (parameters and the input excluded)
    stop: str  # why the run ends where it does ("" if nothing stops it)
    passive: frozenset[str]  # the graph's input and parameter nodes (they compute nothing on tiles)
    grids: Mapping[str, Grid]  # every tiled value's grid, the inputs' too

    @property
    def parts(self) -> int:
        return self.rows * self.cols


def image_input(graph: LayerGraph) -> LayerNode:
    """The graph's one input, an (N, C, H, W) image; SpatialError when there is none."""
    inputs = [node for node in graph if node.kind is NodeKind.INPUT]
    if len(inputs) != 1 or len(inputs[0].output_shape or ()) != 4:
        shapes = [node.output_shape for node in inputs]
        raise SpatialError(f"spatial tiles need one (N, C, H, W) image input; the model takes {shapes}")
    return inputs[0]


def tile_geometry(graph: LayerGraph, rows: int, cols: int) -> TileGeometry:
    """The leading nodes that can run on a ``rows x cols`` grid of the input image, with their halos;
    SpatialError when the model has no image input, its image cannot be cut so, or its first layer
    cannot be tiled."""
    source = image_input(graph)
    _, _, height, width = source.output_shape  # type: ignore[misc]
    grids = {source.name: Grid(balanced_edges(height, rows), balanced_edges(width, cols))}
    found = _walk(graph, (node for node in graph if node.kind not in (NodeKind.INPUT, NodeKind.PARAM)), grids)
    if not found.nodes:
        raise SpatialError(f"the model's first layer cannot run on {rows}x{cols} tiles: {found.stop}")
    return TileGeometry(rows, cols, height, width, found.nodes, found.stop, found.passive,
                        MappingProxyType(grids))


def stage_geometry(graph: LayerGraph, rows: int, cols: int, stage: Sequence[str]) -> TileGeometry:
    """The nodes ``stage`` on a ``rows x cols`` grid of each value it receives (cut over that value's own
    height and width, as a spatial stage after the first receives them); ``height`` and ``width`` are
    those of its first received value. SpatialError when a node of the stage cannot run on tiles."""
    members = set(stage)
    computing = [graph.node(name) for name in stage
                 if graph.node(name).kind not in (NodeKind.INPUT, NodeKind.PARAM)]
    received = list(dict.fromkeys(name for node in computing for name in node.inputs
                                  if name not in members and graph.node(name).kind is not NodeKind.PARAM))
    grids = {}
    for name in received:
        shape = graph.node(name).output_shape or ()
        if len(shape) != 4:
            raise SpatialError(f"the stage receives {name!r} of shape {list(shape)}, not an (N, C, H, W) image")
        grids[name] = Grid(balanced_edges(shape[2], rows), balanced_edges(shape[3], cols))
    found = _walk(graph, iter(computing), grids)
    if found.stop:
        raise SpatialError(found.stop)
    _, _, height, width = graph.node(received[0]).output_shape  # type: ignore[misc]
    return TileGeometry(rows, cols, height, width, found.nodes, "", found.passive, MappingProxyType(grids))


@dataclass(frozen=True)
class _Walk:
    nodes: tuple[NodeTiles, ...]
    stop: str
    passive: frozenset[str]


def _walk(graph: LayerGraph, nodes: Iterator[LayerNode], grids: dict[str, Grid]) -> _Walk:
    """Place ``nodes`` in order on the grids of what they read, until one cannot be (``stop`` says why)."""
    halos: dict[tuple, tuple[Grid, tuple, tuple]] = {}  # (grid, geometry) -> (output grid, sent, received)
    placed: list[NodeTiles] = []
    stop = ""
    for node in nodes:
        try:
            placed.append(_place(graph, node, grids, halos))
        except SpatialError as error:
            stop = str(error)
            break
    passive = frozenset(node.name for node in graph if node.kind in (NodeKind.INPUT, NodeKind.PARAM))
    return _Walk(tuple(placed), stop, passive)


def _place(graph: LayerGraph, node: LayerNode, grids: dict[str, Grid],
           halos: dict[tuple, tuple[Grid, tuple, tuple]]) -> NodeTiles:
    """``node`` on the grid of its inputs (recorded in ``grids``), or SpatialError saying why not
    (``halos`` memoises each window's exchange by input grid and geometry: deep networks repeat them)."""
    label = f"layer {node.name!r} ({node.op_type})"
    tensors = [name for name in node.inputs if graph.node(name).kind is not NodeKind.PARAM]
    if node.kind is NodeKind.OUTPUT or not node.spatially_splittable or "dropout" in node.op_type.lower() \
            or (node.geometry is not None and node.geometry.op == "conv_transpose"):
        raise SpatialError(f"{label} cannot run on tiles; a spatial stage ends before it")
    if not tensors or any(name not in grids for name in tensors):
        raise SpatialError(f"{label} reads a tensor computed after the tiles were joined")
    inputs = {grids[name] for name in tensors}
    if len(inputs) != 1:
        raise SpatialError(f"{label} combines tensors tiled differently")
    grid = inputs.pop()
    if node.geometry is None:
        grids[node.name] = grid
        return NodeTiles(node.name, grid.largest_share, stats_bytes=_stats_bytes(node))
    key = (grid, node.geometry)
    if key not in halos:
        windows = windows_of(node.geometry, layer=node.name, lengths=(grid.row_edges[-1], grid.col_edges[-1]))
        out = Grid(output_edges(grid.row_edges, windows[0], layer=node.name),
                   output_edges(grid.col_edges, windows[1], layer=node.name))
        needed = layer_needed_regions(grid, windows, layer=node.name)
        moves = [halo_transfers(grid, needed, rank) for rank in range(grid.parts)]
        halos[key] = (out, tuple(tuple(_area(region) for _, region in sends) for sends, _ in moves),
                      tuple(tuple(_area(region) for _, region in receives) for _, receives in moves))
    out, sent, received = halos[key]
    grids[node.name] = out
    if not any(sent) and not any(received):  # a 1x1 window: no halo, and no padded copy of its input
        return NodeTiles(node.name, out.largest_share, stats_bytes=_stats_bytes(node))
    return NodeTiles(node.name, out.largest_share, sent, received, tensors[0],
                     grid.row_edges[-1] * grid.col_edges[-1], graph.node(tensors[0]).kind is NodeKind.INPUT)


def _stats_bytes(node: LayerNode) -> int:
    """A batch-norm's two statistics per channel, in its dtype (at least float32); 0 for other nodes."""
    if "batchnorm" not in node.op_type.lower().replace("_", ""):
        return 0
    meta = node.outputs[0]
    itemsize = meta.nbytes // max(1, math.prod(meta.shape))
    return 2 * meta.shape[1] * max(4, itemsize)


def _area(region: Region) -> int:
    return region.area


@dataclass(frozen=True)
class TileCost:
    """One node on the slowest tile, per micro-batch."""

    share: float  # the largest tile's share of the node's output
    fwd_ms: float
    bwd_ms: float
    saved_bytes: float
    transient_bytes: float


def tile_costs(geometry: TileGeometry, table: CostTable, link: LinkSpec,
               allreduce: tuple[float, float]) -> dict[str, TileCost]:
    """Per node of the run, what the slowest tile spends (``table`` gives the whole image's costs at
    the micro-batch size; ``link`` joins the tiles; ``allreduce``: (fixed ms, ms per byte) of an
    all-reduce over them). The input image's tile counts as saved: the runtime holds each micro-batch's
    tile until its backward."""
    costs = {name: TileCost(grid.largest_share, 0.0, 0.0, table[name].output_bytes * grid.largest_share, 0.0)
             for name, grid in geometry.grids.items() if name in geometry.passive}
    for node in geometry.nodes:
        whole = table[node.name]
        fwd_ms, bwd_ms = whole.fwd_ms * node.share, whole.bwd_ms * node.share
        saved = whole.saved_activation_bytes * node.share
        transient = 2 * whole.output_bytes * node.share
        if node.sent_pixels:
            sent, received = _exchange(node, table)
            exchange_ms = max(max(halo_exchange_ms(s, link), halo_exchange_ms(r, link))
                              for s, r in zip(sent, received))
            fwd_ms, bwd_ms = fwd_ms + exchange_ms, bwd_ms + exchange_ms
            most_received = max(sum(r) for r in received)
            # the layer reads (and saves for its backward) a new tensor, its input tile padded with the halo
            padded = table[node.pixel_source].output_bytes * node.share + most_received
            saved, transient = saved + padded, transient + padded
        if node.stats_bytes:
            stats_ms = allreduce[0] + allreduce[1] * node.stats_bytes
            fwd_ms, bwd_ms = fwd_ms + stats_ms, bwd_ms + stats_ms
            # composed of element-wise ops (runtime/spatial/batchnorm.py), it also keeps its centred and
            # its normalised tile for the backward
            saved += 2 * whole.output_bytes * node.share
        costs[node.name] = TileCost(node.share, fwd_ms, bwd_ms, saved, transient)
    return costs


def _exchange(node: NodeTiles, table: CostTable) -> tuple[list[list[int]], list[list[int]]]:
    """A window layer's halo exchange in bytes at ``table``'s micro-batch: per tile, per neighbour, what
    it sends and what it receives."""
    pixel_bytes = table[node.pixel_source].output_bytes / node.source_pixels  # channels x dtype x batch
    return ([[round(p * pixel_bytes) for p in peers] for peers in node.sent_pixels],
            [[round(p * pixel_bytes) for p in peers] for peers in node.received_pixels])


@dataclass(frozen=True)
class GroupExchange:
    """A fused group's halo exchanges (cost_models.fused): per tile, per micro-batch."""

    nodes: tuple[str, ...]  # its members
    sent_bytes: tuple[int, ...]  # by its forward exchange, one per input
    gradient_bytes: tuple[int, ...]  # sent back in the backward: the received halos' gradients (not the image's)


def halo_bytes(geometry: TileGeometry, table: CostTable, stage: Collection[str],
               recomputed: Collection[str] = (), fused: Sequence[GroupExchange] = ()) -> tuple[int, ...]:
    """Per tile, the halo bytes the exchanges of the nodes ``stage`` send per micro-batch: each forward
    exchange (twice for a node in ``recomputed``: its forward runs again in the backward, exchanges
    included), and in the backward the gradient of every halo it received (none for halos of the input
    image, which needs no gradient). A node of a ``fused`` group exchanges nothing itself; the group
    exchanges once per input (again when recomputed: it is recomputed whole)."""
    members, again = set(stage), set(recomputed)
    grouped = {name for group in fused for name in group.nodes}
    total = [0] * geometry.parts
    for node in geometry.nodes:
        if node.name not in members or node.name in grouped or not node.sent_pixels:
            continue
        sent, received = _exchange(node, table)
        forwards = 2 if node.name in again else 1
        for tile in range(geometry.parts):
            total[tile] += forwards * sum(sent[tile]) + (0 if node.reads_image else sum(received[tile]))
    for group in fused:
        forwards = 2 if again.intersection(group.nodes) else 1
        for tile in range(geometry.parts):
            total[tile] += forwards * group.sent_bytes[tile] + group.gradient_bytes[tile]
    return tuple(total)
