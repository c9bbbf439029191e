"""Fused halo groups on a spatial stage: what a run of tiled nodes costs when it exchanges one wide
halo per input instead of one per window layer, and which runs pay for it (now-dl's "design 2").

The runtime runs a fused group as one FusedHaloBlock (runtime/spatial/fused.py): each value the
group reads from outside is exchanged once, over the region cost_models.halo.group_needed_regions
gives; inside, every node computes its needed region (its own tile plus the border that later
layers of the group read), so each node's share of the image grows with the depth of the group
behind it, and its windows pad only at the image border. Per node, on the slowest tile (``share``:
the largest needed region's share of the node's output image):

    fwd_ms = fwd_ms x share (+ the group's exchanges, on its first node; + statistics all-reduce for
             a batch norm, as per layer)
    bwd_ms = bwd_ms x share (+ the exchange of the received halos' gradients, on its first node; + the
             same all-reduce)
    saved  = saved x share (+ a window layer's input block, padded at the image border: a new tensor
             it saves; + a batch norm's centred and normalised outputs, as per layer)

A group pays when its nodes' fwd + bwd on the slowest tile is below their per-layer cost
(cost_models.spatial.tile_costs): fewer messages (their latency) against redundant border compute.
Groups repeat in deep networks, so the region walk is memoised by the group's shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cost_models.comm import halo_exchange_ms
from cost_models.device_spec import LinkSpec
from cost_models.errors import SpatialError
from cost_models.estimation import CostTable
from cost_models.graph.ir import LayerGraph, LayerNode, NodeKind
from cost_models.halo import (
    GroupNode,
    Region,
    WindowPair,
    group_needed_regions,
    halo_transfers,
    tile_region,
    windows_of,
)
from cost_models.spatial import Grid, GroupExchange, TileCost, TileGeometry

Bytes = list[list[list[int]]]  # per input, per tile, per neighbour
MAX_GROUP_BLOCKS = 2  # the longest fused group, in runs between single-value cuts


@dataclass(frozen=True)
class _Shape:
    """A group's region walk on the tile grid (alike for every group of the same shape)."""

    shares: tuple[float, ...]  # per member: the largest tile's needed region over its image
    read_pixels: tuple[int, ...]  # per member: a window's largest input block (padding included); 0 else
    sent_pixels: tuple[tuple[tuple[int, ...], ...], ...]  # per input, per tile, per neighbour
    received_pixels: tuple[tuple[tuple[int, ...], ...], ...]


@dataclass(frozen=True)
class FusedGroup:
    """A run of a spatial stage's nodes that exchanges one wide halo per input, and its costs."""

    exchange: GroupExchange  # its members and the bytes each tile sends
    costs: Mapping[str, TileCost]  # per member, on the slowest tile, per micro-batch

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.exchange.nodes

    @property
    def step_ms(self) -> float:
        """Forward plus backward of the whole group on the slowest tile."""
        return sum(cost.fwd_ms + cost.bwd_ms for cost in self.costs.values())


class _Signatures:
    """Per node of a cost table, a small number that is equal for nodes alike in every cost the fused
    groups' costs read (forward and backward time, saved and output bytes); ``rows`` numbers those
    costs, shared by every table so that a number means the same costs in each."""

    def __init__(self, table: CostTable, rows: dict[tuple, int]) -> None:
        self.table = table
        self._numbers: dict[str, int] = {}
        self._rows = rows

    def __getitem__(self, name: str) -> int:
        number = self._numbers.get(name)
        if number is None:
            row = self.table[name]
            number = self._numbers[name] = self._rows.setdefault(
                (row.fwd_ms, row.bwd_ms, row.saved_activation_bytes, row.output_bytes), len(self._rows))
        return number


class FusedHalos:
    """Fused groups of one tile geometry: their costs, and the choice of those that pay.

    ``graph`` is the traced model, ``geometry`` its tiled run (its grids place every value).
    """

    def __init__(self, graph: LayerGraph, geometry: TileGeometry) -> None:
        self.graph, self.geometry = graph, geometry
        self._shapes: dict[tuple, _Shape] = {}
        self._groups: dict[tuple, tuple[tuple[TileCost, ...], GroupExchange]] = {}  # by shape and costs
        self._cost_numbers: dict[tuple, int] = {}  # see _Signatures
        self._runs: dict[tuple[str, ...], tuple[tuple[LayerNode, ...], tuple, _Shape, tuple[str, ...]] | None] = {}
        self._targets: dict[str, int] = {}
        for tiles in geometry.nodes:
            target = graph.node(tiles.name).target
            self._targets[target] = self._targets.get(target, 0) + 1
        self._stats = {tiles.name: tiles.stats_bytes for tiles in geometry.nodes if tiles.stats_bytes}
        self._reads = {node.name: tuple(name for name in dict.fromkeys(node.inputs)
                                        if graph.node(name).kind is not NodeKind.PARAM) for node in graph}

    def choose(self, units: Sequence[Sequence[str]], table: CostTable, link: LinkSpec,
               allreduce: tuple[float, float], per_layer: Mapping[str, TileCost]) -> tuple[FusedGroup, ...]:
        """The fused groups that make the tiled run fastest: runs of whole ``units`` (the planner's,
        so its recompute and swap decisions never cut a group), each between two points where one
        value alone crosses, of at most ``MAX_GROUP_BLOCKS`` such blocks; every other node exchanges
        per layer (``per_layer``: cost_models.spatial.tile_costs at ``table``'s micro-batch).

        Exact over those segmentations (a shortest path over the unit boundaries): the slowest
        tile's fwd + bwd of the run is the sum of its nodes' (fused or per layer).
        """
        run = []
        for unit in units:
            names = [name for name in unit if name not in self.geometry.passive]
            if any(name not in per_layer for name in names):
                break
            run.append(tuple(unit))
        cuts = self._single_value_cuts(run)
        signature = _Signatures(table, self._cost_numbers)
        best: list[tuple[float, tuple[tuple[str, ...], ...]]] = [(0.0, ())]
        for end in range(1, len(run) + 1):
            step = sum(per_layer[name].fwd_ms + per_layer[name].bwd_ms for name in run[end - 1] if name in per_layer)
            options = [(best[end - 1][0] + step, best[end - 1][1])]
            if end in cuts:
                at = cuts.index(end)
                for start in cuts[max(0, at - MAX_GROUP_BLOCKS):at]:
                    names = tuple(name for unit in run[start:end] for name in unit)
                    costs = self._group_costs(names, table, link, allreduce, signature)
                    if costs is not None:
                        step_ms = sum(cost.fwd_ms + cost.bwd_ms for cost in costs[0])
                        options.append((best[start][0] + step_ms, (*best[start][1], names)))
            best.append(min(options, key=lambda option: option[0]))
        return tuple(group for names in best[-1][1]
                     if (group := self.group(names, table, link, allreduce)) is not None)

    def _single_value_cuts(self, run: Sequence[Sequence[str]]) -> list[int]:
        """Unit boundaries of ``run`` (0 and its end included) that exactly one computed value crosses."""
        position = {name: index for index, unit in enumerate(run) for name in unit}
        last_read: dict[str, int] = {}
        for name, index in position.items():
            users = self.graph.users[name]
            last_read[name] = max((position.get(user, len(run)) for user in users), default=index)
        crossing = [0] * (len(run) + 1)  # values alive across the boundary before unit i
        for name, index in position.items():
            if name in self.geometry.passive:
                continue
            for boundary in range(index + 1, last_read[name] + 1):
                crossing[boundary] += 1
        return [0] + [boundary for boundary in range(1, len(run) + 1) if crossing[boundary] == 1]

    def group(self, names: Sequence[str], table: CostTable, link: LinkSpec,
              allreduce: tuple[float, float]) -> FusedGroup | None:
        """``names`` (the passive input and parameter nodes among them ignored) as one fused group, or
        None when the runtime could not run them so or fusing cannot save a message: a node off the
        tiles, inputs on different grids, a layer also called outside the group, fewer than two
        window layers. ``table`` gives the whole image's costs at the micro-batch size, ``link``
        joins the tiles, ``allreduce`` is (fixed ms, ms per byte) of an all-reduce over them."""
        found = self._group_costs(tuple(names), table, link, allreduce, _Signatures(table, self._cost_numbers))
        if found is None:
            return None
        costs, exchange = found
        members = self._run(tuple(names))[0]  # type: ignore[index]
        return FusedGroup(dataclasses.replace(exchange, nodes=tuple(node.name for node in members)),
                          dict(zip((node.name for node in members), costs)))

    def _group_costs(self, names: tuple[str, ...], table: CostTable, link: LinkSpec, allreduce: tuple[float, float],
                     signature: _Signatures) -> tuple[tuple[TileCost, ...], GroupExchange] | None:
        """group()'s member costs and exchange (its nodes those of the first group alike), memoised: deep
        networks repeat their blocks, alike in shape and in every cost the table gives their nodes and
        inputs (a member's first input is a member or an input, so its pixel bytes are covered)."""
        found = self._run(names)
        if found is None:
            return None
        members, key, shape, inputs = found
        memo = (key, tuple(signature[node.name] for node in members), tuple(signature[name] for name in inputs),
                link, allreduce)
        if memo not in self._groups:
            self._groups[memo] = self._costs(members, shape, table, link, allreduce)
        return self._groups[memo]

    def _costs(self, members: tuple[LayerNode, ...], shape: _Shape, table: CostTable, link: LinkSpec,
               allreduce: tuple[float, float]) -> tuple[tuple[TileCost, ...], GroupExchange]:
        sent, received = self._messages(members, shape, table)
        exchange_ms = max(sum(max(halo_exchange_ms(s[tile], link), halo_exchange_ms(r[tile], link))
                              for s, r in zip(sent, received)) for tile in range(self.geometry.parts))
        costs = []
        for index, (node, share) in enumerate(zip(members, shape.shares)):
            whole = table[node.name]
            fwd_ms, bwd_ms = whole.fwd_ms * share, whole.bwd_ms * share
            saved = whole.saved_activation_bytes * share
            if shape.read_pixels[index]:
                saved += shape.read_pixels[index] * self._pixel_bytes(self._tensors(node)[0], table)
            if node.name in self._stats:
                stats_ms = allreduce[0] + allreduce[1] * self._stats[node.name]
                fwd_ms, bwd_ms = fwd_ms + stats_ms, bwd_ms + stats_ms
                saved += 2 * whole.output_bytes * share
            if index == 0:
                fwd_ms, bwd_ms = fwd_ms + exchange_ms, bwd_ms + exchange_ms
            costs.append(TileCost(share, fwd_ms, bwd_ms, saved, 2 * whole.output_bytes * share))
        return tuple(costs), self._exchange(members, sent, received)

    def exchange(self, names: Sequence[str], table: CostTable) -> GroupExchange:
        """The halo bytes ``names``, run as one fused group, send per tile at ``table``'s micro-batch;
        SpatialError when they cannot run so."""
        found = self._run(tuple(names))
        if found is None:
            raise SpatialError(f"the nodes {list(names)[:3]}... cannot run as one fused halo group")
        members, _, shape, _ = found
        return self._exchange(members, *self._messages(members, shape, table))

    def _messages(self, members: tuple[LayerNode, ...], shape: _Shape,
                  table: CostTable) -> tuple[Bytes, Bytes]:
        """Per input, per tile, per neighbour: the bytes sent and received."""
        pixel_bytes = [self._pixel_bytes(name, table) for name in self._inputs(members)]
        return ([[[round(p * b) for p in peers] for peers in tiles]
                 for tiles, b in zip(shape.sent_pixels, pixel_bytes)],
                [[[round(p * b) for p in peers] for peers in tiles]
                 for tiles, b in zip(shape.received_pixels, pixel_bytes)])

    def _exchange(self, members: tuple[LayerNode, ...], sent: Bytes, received: Bytes) -> GroupExchange:
        inputs = self._inputs(members)
        image = {name for name in inputs if self.graph.node(name).kind is NodeKind.INPUT}
        tiles = range(self.geometry.parts)
        return GroupExchange(tuple(node.name for node in members),
                             tuple(sum(sum(s[tile]) for s in sent) for tile in tiles),
                             tuple(sum(sum(r[tile]) for r, name in zip(received, inputs) if name not in image)
                                   for tile in tiles))

    def _run(self, names: tuple[str, ...]) -> tuple[tuple[LayerNode, ...], tuple, _Shape, tuple[str, ...]] | None:
        """``names``' computing nodes, their region walk and its memo key (which also holds which inputs
        are the image and the members' batch-norm statistics bytes), and the values they read from
        outside; None when they cannot run fused. Alike at every micro-batch size: computed once."""
        if names not in self._runs:
            members = self._members(names)
            found = self._shape(members)
            if found is None:
                self._runs[names] = None
            else:
                inputs = self._inputs(members)
                key = (found[0], tuple(self.graph.node(name).kind is NodeKind.INPUT for name in inputs),
                       tuple(self._stats.get(node.name, 0) for node in members))
                self._runs[names] = (members, key, found[1], inputs)
        return self._runs[names]

    def _members(self, names: Sequence[str]) -> tuple[LayerNode, ...]:
        """The computing nodes of ``names``; none when an input or parameter node sits among them (a
        recompute region would split there, inside the group)."""
        computing = [index for index, name in enumerate(names) if name not in self.geometry.passive]
        if not computing or computing[-1] - computing[0] + 1 != len(computing):
            return ()
        return tuple(self.graph.node(names[index]) for index in computing)

    def _pixel_bytes(self, name: str, table: CostTable) -> float:
        """Bytes of one pixel (channels x dtype x batch) of value ``name`` at ``table``'s micro-batch."""
        grid = self.geometry.grids[name]
        return table[name].output_bytes / (grid.row_edges[-1] * grid.col_edges[-1])

    def _shape(self, members: tuple[LayerNode, ...]) -> tuple[tuple, _Shape] | None:
        """The group's region walk and its memo key (its layers, wiring and input grid), or None when
        the group cannot run fused or cannot save a message."""
        grids = self.geometry.grids
        if not members or any(node.name not in grids or node.kind in (NodeKind.INPUT, NodeKind.PARAM)
                              for node in members):
            return None
        inputs = self._inputs(members)
        names = {node.name: index for index, node in enumerate(members)}
        kept = tuple(node.name for node in members if not self.graph.users[node.name]
                     or any(user not in names for user in self.graph.users[node.name]))
        input_grids = {grids[name] for name in inputs}
        windows = sum(1 for node in members if node.geometry is not None)
        if len(input_grids) != 1 or windows < 2 or any(
                self._targets.get(node.target, 0) > 1 for node in members if node.geometry is not None):
            return None
        wiring = tuple(tuple(names[name] if name in names else -1 - inputs.index(name)
                             for name in self._tensors(node)) for node in members)
        key = (tuple(node.geometry for node in members), wiring, tuple(node.name in kept for node in members),
               input_grids.pop())
        if key not in self._shapes:
            self._shapes[key] = self._walk(members, inputs, kept)
        return key, self._shapes[key]

    def _walk(self, members: tuple[LayerNode, ...], inputs: tuple[str, ...], kept: tuple[str, ...]) -> _Shape:
        grids = self.geometry.grids
        steps = tuple(GroupNode(node.name, self._tensors(node), self._windows(node)) for node in members)
        tiles = range(self.geometry.parts)
        needed = [group_needed_regions(steps, kept, lambda name, t=tile: tile_region(grids[name], t),
                                       lambda name: _image(grids[name])) for tile in tiles]
        shares = tuple(max(needed[tile][node.name].area for tile in tiles) / _image(grids[node.name]).area
                       for node in members)
        read = tuple(max(_block(step.windows, needed[tile][step.name]) for tile in tiles) if step.windows
                     else 0 for step in steps)
        moves = [[halo_transfers(grids[name], [needed[tile][name] for tile in tiles], tile) for tile in tiles]
                 for name in inputs]
        return _Shape(shares, read,
                      tuple(tuple(tuple(region.area for _, region in sends) for sends, _ in per_tile)
                            for per_tile in moves),
                      tuple(tuple(tuple(region.area for _, region in receives) for _, receives in per_tile)
                            for per_tile in moves))

    def _tensors(self, node: LayerNode) -> tuple[str, ...]:
        """The values ``node`` reads, parameters left out (as cost_models.spatial places it)."""
        return self._reads[node.name]

    def _inputs(self, members: Sequence[LayerNode]) -> tuple[str, ...]:
        """The values a group reads from outside it, in first-read order."""
        inside = {node.name for node in members}
        return tuple(dict.fromkeys(name for node in members for name in self._tensors(node)
                                   if name not in inside))

    def _windows(self, node: LayerNode) -> WindowPair | None:
        if node.geometry is None:
            return None
        grid = self.geometry.grids[self._tensors(node)[0]]
        return windows_of(node.geometry, layer=node.name, lengths=(grid.row_edges[-1], grid.col_edges[-1]))


def _image(grid: Grid) -> Region:
    return Region(0, grid.row_edges[-1], 0, grid.col_edges[-1])


def _block(windows: WindowPair, out_region: Region) -> int:
    """Pixels of the input block a window layer reads for ``out_region``, border padding included."""
    row_lo, row_hi = windows[0].input_span(out_region.row_lo, out_region.row_hi)
    col_lo, col_hi = windows[1].input_span(out_region.col_lo, out_region.col_hi)
    return (row_hi - row_lo) * (col_hi - col_lo)
