"""A spatial stage's module on this rank's tile: per-layer or fused halos, recompute and swap, one cut.

The stage's GraphModule keeps the plan's node names, which name its spatial section's fused groups
and its offload section's recompute regions and swapped nodes. From it:

* every conv, pool and batch-norm layer outside the fused groups becomes its tiled version
  (runtime.spatial.spatialize: one halo exchange per conv/pool layer, batch-norm statistics
  all-reduced over the tile group);
* with fused halos, each fused group (a run of the stage's nodes; the whole stage when the section
  lists none) is cut out of the graph and runs as one FusedHaloBlock: one wide halo exchange for
  each value the group reads from outside it, before its first layer, and none inside. The stage's
  nodes outside every group keep per-layer halos, so groups need not cover the stage;
* each recompute region and each run of swapped nodes is cut out in the same pass
  (runtime/regions.py) and wrapped as on any stage (runtime/offload.py), recomputed whole
  (runtime/recompute.py, ``communicates``: its halo exchanges and all-reduces are collectives that
  every tile must run alike).

A FusedHaloBlock computes its group as a whole from the wide halo, so no region can start or end
inside it: a recompute region holds whole groups or none (each group one block inside the
checkpointed region), and a swapped run is one whole group (the block is then swapped) or shares
no node with any. A group's inputs share one tile grid (the block exchanges
them over one grid). Tags keep exchanges apart on the tile group: layer k of the stage's
conv/pool/batch-norm calls uses tag k (spatialize), and the fused groups' exchanges number on from
the count of the stage's nodes.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from dataclasses import dataclass

import torch.fx
from torch import nn

from cost_models.errors import RuntimeSetupError
from planner.plan import HaloMode, OffloadSpec, SpatialSpec
from runtime import regions
from runtime.offload import recompute_regions
from runtime.recompute import Checkpointed
from runtime.spatial import FusedHaloBlock, TileGrid, spatialize
from runtime.spatial.graph import Role, SpatialGraph, analyse
from runtime.swap import Swapped, SwapSpace
from runtime.tiles import TiledStage


@dataclass(frozen=True)
class Piece:
    """A run of the stage's nodes cut into a submodule of its own, and what runs it."""

    nodes: tuple[str, ...]
    fused: bool = False  # one FusedHaloBlock
    recomputed: bool = False
    swapped: bool = False
    groups: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # fused groups inside it


def fused_groups(module: torch.fx.GraphModule, spec: SpatialSpec) -> dict[str, tuple[str, ...]]:
    """Label (``fused_groups[g]``) -> nodes of each fused group: none with per-layer halos, the whole
    stage with fused halos and no groups listed."""
    if spec.halo is not HaloMode.FUSED:
        return {}
    groups = spec.fused_groups or (regions.compute_nodes(module),)
    return {f"fused_groups[{index}]": tuple(group) for index, group in enumerate(groups)}


def pieces(module: torch.fx.GraphModule, spec: SpatialSpec, offload: OffloadSpec, *,
           stage: int) -> dict[str, Piece]:
    """Label -> every run the stage is cut into: fused groups, recompute regions, swapped runs.

    Example: a stage fusing ``(conv1, bn1, relu)`` and recomputing that same run gives
    ``{"fused_groups[0]": Piece(("conv1", "bn1", "relu"), fused=True, recomputed=True)}``.
    """
    groups = fused_groups(module, spec)
    found = {label: Piece(nodes, fused=True) for label, nodes in groups.items()}
    group_of = {node: label for label, nodes in groups.items() for node in nodes}
    recomputed = recompute_regions(offload)
    offloaded = {**recomputed, **_swap_runs(module, offload, group_of)}
    for label, nodes in offloaded.items():
        wrapping = {"recomputed": label in recomputed, "swapped": label not in recomputed}
        hit = sorted({group_of[node] for node in nodes if node in group_of})
        inside = set(nodes)
        if not hit:
            found[label] = Piece(nodes, **wrapping)
        elif len(hit) == 1 and set(groups[hit[0]]) == inside:
            found[hit[0]] = dataclasses.replace(found[hit[0]], **wrapping)
        elif label in recomputed and all(inside.issuperset(groups[group]) for group in hit):
            found[label] = Piece(nodes, recomputed=True, groups={group: groups[group] for group in hit})
            for group in hit:
                del found[group]
        else:
            raise RuntimeSetupError(f"stage {stage}'s offload {label} {list(nodes)} cuts into the spatial "
                                    f"{', '.join(hit)} (a fused group runs as a whole); recompute whole fused "
                                    f"groups (alone or among other nodes), swap whole groups or nodes outside "
                                    f"them, or re-plan without it")
    return found


def _swap_runs(module: torch.fx.GraphModule, offload: OffloadSpec,
               group_of: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Runs of swapped nodes consecutive in the stage and in the same fused group (or none), ``swap[i]``."""
    swapped = set(offload.swap)
    runs: list[list[str]] = []
    previous: tuple[bool, str | None] = (False, None)
    for name in regions.compute_nodes(module):
        key = (name in swapped, group_of.get(name))
        if key[0] and key != previous:
            runs.append([])
        if key[0]:
            runs[-1].append(name)
        previous = key
    return {f"swap[{index}]": tuple(run) for index, run in enumerate(runs)}


def check_spatial_stage(module: torch.fx.GraphModule, spec: SpatialSpec, offload: OffloadSpec,
                        input_grids: Mapping[str, TileGrid], *, stage: int) -> None:
    """Refuse, before any communication and alike on every rank, fused groups the stage cannot run
    and recompute or swap regions that cut into them (the offload regions themselves are checked
    by runtime.offload.check_offload). ``input_grids``: the tiling of the images the stage
    receives (runtime.tiles.input_grids)."""
    groups = fused_groups(module, spec)
    regions.check(module, groups, stage=stage, section="spatial")
    pieces(module, spec, offload, stage=stage)
    graph = analyse(module, _grid(spec), input_grids)
    for label, nodes in groups.items():
        _input_grid(graph, label, nodes, stage)
    _check_layers_apart(graph, groups, stage)


def _check_layers_apart(graph: SpatialGraph, groups: Mapping[str, tuple[str, ...]], stage: int) -> None:
    """A conv, pool or batch-norm layer called inside a fused group is called by no node outside
    the groups (that node would tile the layer itself, per layer)."""
    group_of = {node: label for label, nodes in groups.items() for node in nodes}
    callers: dict[str, set[str | None]] = {}
    for node in graph.nodes:
        if node.role in (Role.WINDOW, Role.BATCH_NORM):
            callers.setdefault(node.layer, set()).add(group_of.get(node.name))
    for layer, where in callers.items():
        if None in where and len(where) > 1:
            inside = sorted(label for label in where if label is not None)
            raise RuntimeSetupError(f"stage {stage}'s layer {layer!r} is called inside the spatial "
                                    f"{', '.join(inside)} and outside every fused group; give each call its "
                                    f"own layer or put all of them in fused groups")


def _grid(spec: SpatialSpec) -> TileGrid:
    return TileGrid.build(spec.parts, spec.slicing.value, spec.height, spec.width)


def _input_grid(graph: SpatialGraph, label: str, nodes: tuple[str, ...], stage: int) -> TileGrid:
    """The one tile grid of every value fused group ``nodes`` reads from outside it."""
    inside = set(nodes)
    read = dict.fromkeys(name for node in nodes for name in graph[node].inputs if name not in inside)
    grids = {name: graph[name].grid for name in read}
    if len(set(grids.values())) != 1 or None in grids.values():
        shapes = {name: None if grid is None else (grid.row_edges, grid.col_edges) for name, grid in grids.items()}
        raise RuntimeSetupError(f"stage {stage}'s spatial {label} reads values tiled differently (row and column "
                                f"edges {shapes}); start the group where the values it reads share one tile grid")
    return next(iter(grids.values()))  # type: ignore[return-value]


def tile_stage(module: torch.fx.GraphModule, tiled: TiledStage, spec: SpatialSpec, offload: OffloadSpec,
               space: SwapSpace, *, timeout_s: float) -> nn.Module:
    """The stage's module on this rank's tile, with its fused groups and its recompute and swap regions.

    Example::

        module = tile_stage(stage_module, tiled, plan.stages[0].spatial, plan.stages[0].offload, swaps,
                            timeout_s=300)
        y_tiles = module(tiled.tile_input(x))      # this rank's tile of every value the stage sends
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    cut = pieces(module, spec, offload, stage=tiled.stage)
    fused = {node for piece in cut.values() if piece.fused for node in piece.nodes}
    fused.update(node for piece in cut.values() for nodes in piece.groups.values() for node in nodes)
    on_tiles = spatialize(module, tiled.grid, tiled.group, timeout=timeout, keep=fused,
                          input_grids=tiled.input_grids)
    if not cut:
        return on_tiles
    assert isinstance(on_tiles, torch.fx.GraphModule)
    graph = analyse(module, tiled.grid, tiled.input_grids)
    split, names = regions.cut(on_tiles, {label: piece.nodes for label, piece in cut.items()},
                               stage=tiled.stage, section="spatial")
    tag = len(graph.nodes)  # above every per-layer tag (see the module docstring)
    for label, piece in cut.items():
        region: nn.Module = split.get_submodule(names[label])
        if piece.fused:
            block = FusedHaloBlock(region, _input_grid(graph, label, piece.nodes, tiled.stage), tiled.group,
                                   tag=tag, timeout=timeout)
            region, tag = block, tag + len(block.halo_exchanges)
        if piece.groups:  # a recompute region holding whole fused groups: each one block inside it
            assert isinstance(region, torch.fx.GraphModule)
            region, inner = regions.cut(region, piece.groups, stage=tiled.stage, section="spatial")
            for group, nodes in piece.groups.items():
                block = FusedHaloBlock(region.get_submodule(inner[group]),
                                       _input_grid(graph, group, nodes, tiled.stage), tiled.group, tag=tag,
                                       timeout=timeout)
                setattr(region, inner[group], block)
                tag += len(block.halo_exchanges)
        if piece.recomputed:
            region = Checkpointed(region, communicates=True)
        if piece.swapped:
            region = Swapped(region, space)
        setattr(split, names[label], region)
    return split
