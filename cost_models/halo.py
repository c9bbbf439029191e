"""Halo geometry and cost: which pixels each image tile needs from its neighbours, and what moving them costs.

The arithmetic here is shared by the planner (costs) and the runtime (runtime/spatial builds its
exchanges from the same functions), so a predicted byte count is the byte count the runtime sends.

Conventions (per spatial dimension, all ranges half-open ``[lo, hi)`` in image pixels):

- A tile grid is given by its edges: ``row_edges = (0, e1, ..., H)`` and ``col_edges = (0, ..., W)``;
  rank ``r`` owns tile ``(r // cols, r % cols)`` (row-major).
- **Output ownership**: output pixel ``o`` of a window (kernel k, stride s, padding p, dilation d)
  belongs to the tile holding its *anchor* input pixel ``o*s - p + d*(k-1)//2`` (the receptive
  field's centre, clamped into the image). For a "same" convolution the anchor is ``o*s``, so a
  stride-1 layer keeps the tiling unchanged and a stride-2 layer halves every edge, rounding up.
- A tile computing outputs ``[o0, o1)`` reads inputs ``[o0*s - p, (o1-1)*s - p + d*(k-1) + 1)``;
  the part outside the image is padding, the part outside its own tile is its halo.

Pure functions of integers; imports the standard library and cost_models only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cost_models.comm import halo_exchange_ms
from cost_models.errors import SpatialError

if TYPE_CHECKING:
    from cost_models.device_spec import LinkSpec
    from cost_models.graph.ir import Geometry

__all__ = [
    "HaloCost",
    "JoinCost",
    "Region",
    "TileEdges",
    "Window",
    "balanced_edges",
    "ceil_mode_refusal",
    "ceil_rounds_up",
    "chain_halo_cost",
    "chain_needed_regions",
    "halo_cost",
    "halo_transfers",
    "layer_needed_regions",
    "needed_region",
    "output_edges",
    "tile_join_cost",
    "tile_region",
    "windows_of",
]

Edges = tuple[int, ...]


class TileEdges(Protocol):
    """Anything describing a tile grid by its edges (runtime.spatial.TileGrid is one)."""

    @property
    def row_edges(self) -> Edges: ...

    @property
    def col_edges(self) -> Edges: ...


@dataclass(frozen=True)
class Region:
    """A rectangle of image pixels: rows ``[row_lo, row_hi)`` by columns ``[col_lo, col_hi)``."""

    row_lo: int
    row_hi: int
    col_lo: int
    col_hi: int

    @property
    def height(self) -> int:
        return max(0, self.row_hi - self.row_lo)

    @property
    def width(self) -> int:
        return max(0, self.col_hi - self.col_lo)

    @property
    def area(self) -> int:
        return self.height * self.width

    @property
    def is_empty(self) -> bool:
        return self.area == 0

    def intersect(self, other: Region) -> Region:
        """The overlap of two rectangles (possibly empty)."""
        return Region(max(self.row_lo, other.row_lo), min(self.row_hi, other.row_hi),
                      max(self.col_lo, other.col_lo), min(self.col_hi, other.col_hi))

    def hull(self, other: Region) -> Region:
        """The smallest rectangle holding both (an empty rectangle is ignored)."""
        if self.is_empty:
            return other
        if other.is_empty:
            return self
        return Region(min(self.row_lo, other.row_lo), max(self.row_hi, other.row_hi),
                      min(self.col_lo, other.col_lo), max(self.col_hi, other.col_hi))

    def contains(self, other: Region) -> bool:
        """Whether ``other`` lies inside this rectangle (an empty one always does)."""
        return other.is_empty or self.intersect(other) == other

    def offsets_in(self, outer: Region) -> tuple[slice, slice]:
        """Row and column slices selecting this rectangle out of a tensor that covers ``outer``.

        Example: ``Region(4, 6, 0, 2).offsets_in(Region(2, 8, 0, 4)) == (slice(2, 4), slice(0, 2))``.
        """
        assert outer.contains(self), f"{self} is not inside {outer}"
        return (slice(self.row_lo - outer.row_lo, self.row_hi - outer.row_lo),
                slice(self.col_lo - outer.col_lo, self.col_hi - outer.col_lo))


@dataclass(frozen=True)
class Window:
    """A sliding window along one dimension: kernel, stride, symmetric zero padding, dilation.

    Example: ``Window(3, stride=2, padding=1).output_length(7) == 4``.
    """

    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1

    def __post_init__(self) -> None:
        if min(self.kernel, self.stride, self.dilation) < 1 or self.padding < 0:
            raise SpatialError(f"{self} is not a valid window: kernel, stride and dilation must be >= 1 "
                               f"and padding >= 0")

    @property
    def span(self) -> int:
        """Input pixels one output reads, end to end: ``d*(k-1) + 1``."""
        return self.dilation * (self.kernel - 1) + 1

    @property
    def anchor_offset(self) -> int:
        """Distance from a window's first input pixel to its anchor (centre): ``d*(k-1)//2``."""
        return self.dilation * (self.kernel - 1) // 2

    def output_length(self, length: int) -> int:
        """Outputs along a dimension of ``length`` inputs (floor mode, as PyTorch without ceil_mode)."""
        count = (length + 2 * self.padding - self.span) // self.stride + 1
        if count < 1:
            raise SpatialError(f"{self} gives no output for an input of length {length}; "
                               f"the padded input must be at least {self.span} pixels")
        return count

    def ceil_output_length(self, length: int) -> int:
        """Outputs along a dimension of ``length`` inputs in ceil mode (PyTorch's rule: the last window
        must start inside the input or its left padding)."""
        count = -(-(length + 2 * self.padding - self.span) // self.stride) + 1
        if (count - 1) * self.stride >= length + self.padding:
            count -= 1
        return count

    def output_edge(self, edge: int, length: int) -> int:
        """The first output owned by the tile starting at input pixel ``edge`` (the ownership rule)."""
        outputs = self.output_length(length)
        if edge <= 0:
            return 0
        if edge >= length:
            return outputs
        first = -((self.anchor_offset - edge - self.padding) // self.stride)  # ceil((edge+p-c)/s)
        return min(max(first, 0), outputs)

    def input_span(self, out_lo: int, out_hi: int) -> tuple[int, int]:
        """Inputs ``[lo, hi)`` that outputs ``[out_lo, out_hi)`` read, before clamping to the image."""
        lo = out_lo * self.stride - self.padding
        return lo, (out_hi - 1) * self.stride - self.padding + self.span


WindowPair = tuple[Window, Window]


def windows_of(geometry: Geometry, *, layer: str = "window", lengths: tuple[int, int] | None = None) -> WindowPair:
    """The (row, column) windows of a 2-d conv or pool Geometry; SpatialError if it cannot be tiled.

    A ceil-mode pool tiles as its floor-mode twin where the input's ``lengths`` (height, width) give
    both the same output size (every even size through a 2x2 stride-2 pool): pass them to allow it."""
    if geometry.op not in ("conv", "max_pool", "avg_pool"):
        raise SpatialError(f"layer {layer!r}: a {geometry.op} layer cannot run on tiles; only conv, max_pool and "
                           f"avg_pool windows can (join the tiles before it)")
    if geometry.padding_mode != "zeros":
        raise SpatialError(f"layer {layer!r}: padding_mode={geometry.padding_mode!r} cannot be tiled exactly; "
                           f"use padding_mode='zeros' or join the tiles before this layer")
    if len(geometry.kernel) != 2:
        raise SpatialError(f"layer {layer!r}: only 2-d windows can be tiled, got kernel {geometry.kernel}")
    windows = tuple(Window(k, s, p, d) for k, s, p, d in
                    zip(geometry.kernel, geometry.stride, geometry.padding, geometry.dilation))
    if geometry.ceil_mode and (lengths is None or ceil_rounds_up(windows, lengths)):  # type: ignore[arg-type]
        raise SpatialError(f"layer {layer!r}: {ceil_mode_refusal(lengths)}")
    return windows  # type: ignore[return-value]


def ceil_rounds_up(windows: WindowPair, lengths: tuple[int, int]) -> bool:
    """Whether ceil mode gives more outputs than floor mode at these input (height, width): only then
    does a ceil-mode pool differ from its floor-mode twin, which is what tiles compute."""
    return any(window.ceil_output_length(length) != window.output_length(length)
               for window, length in zip(windows, lengths))


def ceil_mode_refusal(lengths: tuple[int, int] | None) -> str:
    """Why a ceil-mode window cannot be tiled (the message's tail, after the layer's name)."""
    return (f"ceil_mode=True rounds up at input size {lengths}, which tiles cannot reproduce; use "
            f"ceil_mode=False, an input size where it does not round up, or join the tiles before this layer")


def balanced_edges(length: int, parts: int) -> Edges:
    """Edges splitting ``length`` pixels into ``parts`` tiles whose sizes differ by at most one.

    The first ``length % parts`` tiles get the extra pixel. Example: ``balanced_edges(10, 4) ==
    (0, 3, 6, 8, 10)``.
    """
    if parts < 1 or length < parts:
        raise SpatialError(f"cannot split {length} pixels into {parts} tiles; need at least one pixel "
                           f"per tile (length >= {parts})")
    base, extra = divmod(length, parts)
    edges = [0]
    for tile in range(parts):
        edges.append(edges[-1] + base + (1 if tile < extra else 0))
    return tuple(edges)


def output_edges(edges: Edges, window: Window, *, layer: str = "window") -> Edges:
    """The output tiling a window produces from input tiling ``edges`` under the ownership rule.

    Raises SpatialError naming ``layer`` when a tile would own no output pixel.
    """
    length = edges[-1]
    result = tuple(window.output_edge(edge, length) for edge in edges)
    sizes = [hi - lo for lo, hi in itertools.pairwise(result)]
    if min(sizes) < 1:
        raise SpatialError(f"layer {layer!r}: input tiles {_sizes(edges)} give output tiles {sizes} through {window}; "
                           f"a tile would own no output pixel; use fewer tiles or a larger image")
    return result


def tile_region(grid: TileEdges, rank: int) -> Region:
    """The pixels rank ``rank`` owns in a grid (row-major rank order)."""
    cols = len(grid.col_edges) - 1
    row, col = divmod(rank, cols)
    return Region(grid.row_edges[row], grid.row_edges[row + 1], grid.col_edges[col], grid.col_edges[col + 1])


def _ranks(grid: TileEdges) -> range:
    return range((len(grid.row_edges) - 1) * (len(grid.col_edges) - 1))


def _image(grid: TileEdges) -> Region:
    return Region(0, grid.row_edges[-1], 0, grid.col_edges[-1])


def _sizes(edges: Edges) -> list[int]:
    return [hi - lo for lo, hi in itertools.pairwise(edges)]


def needed_region(windows: WindowPair, out_region: Region, image: Region) -> Region:
    """Input pixels (clamped to the image) that computing ``out_region`` of a window layer reads."""
    row_lo, row_hi = windows[0].input_span(out_region.row_lo, out_region.row_hi)
    col_lo, col_hi = windows[1].input_span(out_region.col_lo, out_region.col_hi)
    return Region(row_lo, row_hi, col_lo, col_hi).intersect(image)


@dataclass(frozen=True)
class _Edges:
    row_edges: Edges
    col_edges: Edges


def _after(grid: TileEdges, windows: WindowPair, layer: str) -> _Edges:
    return _Edges(output_edges(grid.row_edges, windows[0], layer=layer),
                  output_edges(grid.col_edges, windows[1], layer=layer))


def layer_needed_regions(grid: TileEdges, windows: WindowPair, *, layer: str = "window") -> tuple[Region, ...]:
    """For every rank, the input pixels its share of one window layer's output reads."""
    out_grid = _after(grid, windows, layer)
    return tuple(needed_region(windows, tile_region(out_grid, rank), _image(grid)) for rank in _ranks(grid))


def chain_needed_regions(grid: TileEdges, chain: Sequence[WindowPair]) -> tuple[Region, ...]:
    """For every rank, the input pixels a fused chain of window layers reads (one wide halo).

    Walking back from the rank's own output tile, each layer's needed input is widened to cover
    the rank's own tile at that level too, so every activation is computed by its owner.
    """
    grids: list[TileEdges] = [grid]
    for index, windows in enumerate(chain):
        grids.append(_after(grids[-1], windows, str(index)))
    regions = []
    for rank in _ranks(grid):
        need = tile_region(grids[-1], rank)
        for level in range(len(chain) - 1, -1, -1):
            need = needed_region(chain[level], need, _image(grids[level]))
            need = need.hull(tile_region(grids[level], rank))
        regions.append(need)
    return tuple(regions)


_NOTHING = Region(0, 0, 0, 0)


@dataclass(frozen=True)
class GroupNode:
    """One node of a fused group, for :func:`group_needed_regions`: the values it reads and, for a
    window layer, its windows (None: it reads each input over its own output region)."""

    name: str
    inputs: tuple[str, ...]
    windows: WindowPair | None = None


def group_needed_regions(nodes: Sequence[GroupNode], kept: Iterable[str], own: Callable[[str], Region],
                         image: Callable[[str], Region]) -> dict[str, Region]:
    """For one rank, the region every value of a fused group must cover (its inputs included: what
    their one wide halo exchange fills), so the values ``kept`` (read after the group) are exact on
    the rank's own tile.

    Walking ``nodes`` (in execution order) backwards, a node covers its own tile (``own(name)``: each
    activation is computed by its owner, so batch-norm statistics count owned pixels once) hulled
    with what later nodes read of it; a window layer reads its output region widened by
    :func:`needed_region` and clamped to its input's ``image(name)``, any other node reads its
    inputs over its own region. The planner's fused-halo costs and the runtime's FusedHaloBlock
    both use this walk.
    """
    required = {name: own(name) for name in kept}
    needed: dict[str, Region] = {}
    for node in reversed(nodes):
        need = own(node.name).hull(required.get(node.name, _NOTHING))
        needed[node.name] = need
        for source in node.inputs:
            reads = need if node.windows is None else needed_region(node.windows, need, image(source))
            required[source] = required.get(source, _NOTHING).hull(reads)
    for source, reads in required.items():
        needed.setdefault(source, own(source).hull(reads))
    return needed


Transfer = tuple[int, Region]


def halo_transfers(grid: TileEdges, needed: Sequence[Region], rank: int) -> tuple[tuple[Transfer, ...],
                                                                                   tuple[Transfer, ...]]:
    """What ``rank`` sends and receives so every rank holds its ``needed`` region.

    Returns ``(sends, receives)``, each a tuple of ``(peer, region)`` in peer order: a send is the part
    of ``needed[peer]`` that ``rank`` owns, a receive the part of ``needed[rank]`` that ``peer`` owns.
    Usually the peers are the up-to-8 neighbours; a halo wider than a neighbouring tile reaches on.
    """
    own = tile_region(grid, rank)
    sends, receives = [], []
    for peer in _ranks(grid):
        if peer == rank:
            continue
        outgoing = needed[peer].intersect(own)
        incoming = needed[rank].intersect(tile_region(grid, peer))
        if not outgoing.is_empty:
            sends.append((peer, outgoing))
        if not incoming.is_empty:
            receives.append((peer, incoming))
    return tuple(sends), tuple(receives)


@dataclass(frozen=True)
class HaloCost:
    """One rank's halo exchange: bytes to and from each peer, messages sent, and the time.

    ``exchange_ms`` is the larger of the send and the receive side of
    cost_models.comm.halo_exchange_ms (a full-duplex link carries both at once).
    """

    rank: int
    send_bytes: tuple[tuple[int, int], ...]  # (peer, bytes)
    recv_bytes: tuple[tuple[int, int], ...]  # (peer, bytes)
    exchange_ms: float

    @property
    def messages(self) -> int:
        return len(self.send_bytes)

    @property
    def bytes_sent(self) -> int:
        return sum(nbytes for _, nbytes in self.send_bytes)


def _cost_of(grid: TileEdges, needed: Sequence[Region], rank: int, pixel_bytes: int, link: LinkSpec) -> HaloCost:
    sends, receives = halo_transfers(grid, needed, rank)
    send = tuple((peer, region.area * pixel_bytes) for peer, region in sends)
    recv = tuple((peer, region.area * pixel_bytes) for peer, region in receives)
    exchange_ms = max(halo_exchange_ms([n for _, n in send], link), halo_exchange_ms([n for _, n in recv], link))
    return HaloCost(rank, send, recv, exchange_ms)


def _pixel_bytes(channels: int, dtype_bytes: int, batch: int) -> int:
    if min(channels, dtype_bytes, batch) < 1:
        raise SpatialError(f"channels={channels}, dtype_bytes={dtype_bytes} and batch={batch} must all be >= 1")
    return channels * dtype_bytes * batch


def halo_cost(geometry: Geometry, grid: TileEdges, rank: int, *, channels: int, dtype_bytes: int,
              batch: int, link: LinkSpec, layer: str = "window") -> HaloCost:
    """Halo bytes per neighbour, messages and exchange time of one conv/pool layer for ``rank``.

    ``channels`` is the layer's input channels per sample. Example (3x3 conv, 2 vertical strips of
    an 8x8 image, 4 channels, float32, batch 1): each rank sends one 8x1 column, 128 bytes::

        halo_cost(Geometry("conv", (3, 3), (1, 1), (1, 1), (1, 1)), grid, 0, channels=4,
                  dtype_bytes=4, batch=1, link=link).send_bytes == ((1, 128),)
    """
    windows = windows_of(geometry, layer=layer, lengths=(grid.row_edges[-1], grid.col_edges[-1]))
    needed = layer_needed_regions(grid, windows, layer=layer)
    return _cost_of(grid, needed, rank, _pixel_bytes(channels, dtype_bytes, batch), link)


def chain_halo_cost(geometries: Sequence[Geometry], grid: TileEdges, rank: int, *, channels: int,
                    dtype_bytes: int, batch: int, link: LinkSpec) -> HaloCost:
    """The one wide halo a fused chain of conv/pool layers exchanges before its first layer."""
    chain: list[WindowPair] = []
    lengths = (grid.row_edges[-1], grid.col_edges[-1])
    for index, geometry in enumerate(geometries):
        chain.append(windows_of(geometry, layer=str(index), lengths=lengths))
        lengths = (chain[-1][0].output_length(lengths[0]), chain[-1][1].output_length(lengths[1]))
    needed = chain_needed_regions(grid, chain)
    return _cost_of(grid, needed, rank, _pixel_bytes(channels, dtype_bytes, batch), link)


@dataclass(frozen=True)
class JoinCost:
    """Gathering every tile onto one rank: bytes it receives, messages, and the time."""

    dst: int
    bytes_received: int
    messages: int
    join_ms: float


def tile_join_cost(grid: TileEdges, *, channels: int, dtype_bytes: int, batch: int, link: LinkSpec,
                   dst: int = 0) -> JoinCost:
    """The join before the first non-spatial stage: ``dst`` receives every other rank's tile.

    The messages arrive over ``dst``'s one link, so the time is modelled as a halo exchange with
    every other rank (k latencies plus all bytes over the bandwidth).
    """
    pixel_bytes = _pixel_bytes(channels, dtype_bytes, batch)
    sizes = [tile_region(grid, rank).area * pixel_bytes for rank in _ranks(grid) if rank != dst]
    return JoinCost(dst, sum(sizes), len(sizes), halo_exchange_ms(sizes, link))
