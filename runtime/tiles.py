"""Spatial stages at run time: their tile grids and tile groups, and what crosses their edges.

A spatial stage (the plan's ``stages[p].spatial``) runs on the ranks of its slot, one image tile
each: tile ``t`` of a replica is ``layout.ranks_of(stage, replica)[t]``, at row ``t // cols`` and
column ``t % cols`` of the tile grid. The spatial stages are the plan's leading stages 0..k-1
(runtime/checks.py). Stage 0's tile ranks take the same micro-batch and keep their tile of the
image; a later spatial stage receives every value from an earlier one tiled over that value's own
height and width (balanced, its own tile count and slicing), re-tiled from the sender's tiles
(runtime/retiling.py). Each runs its module through runtime.spatial (halos exchanged on its own
tile group) and sends its output tile of every value to a non-spatial consumer stage's rank, which
joins the tiles (one receive per tile rank, in tile order, in the same batch) and, in the
backward, sends each tile rank its slice of the gradient. Replicated weights' gradients are summed
by the part's ``ALLREDUCE`` over every copy (tiles and replicas in one group, runtime/grads.py).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from cost_models.errors import RuntimeSetupError
from planner.plan import HaloMode, Plan
from runtime.dataflow import Dataflow, SourceKind
from runtime.spatial import TileGrid, count_messages
from runtime.spatial.graph import analyse, trace_spatial
from runtime.values import ValueKind, ValueSpec


@dataclass(frozen=True)
class TiledStage:
    """One spatial stage as every rank sees it; ``tile`` and ``group`` are set on its tile ranks only
    (its module on the tile: runtime/spatial_stage.py)."""

    stage: int
    halo: HaloMode
    grid: TileGrid  # of the stage's input image (the spatial section's height x width)
    input_grids: Mapping[str, TileGrid]  # the tile grid of every image the stage receives, by input name
    output_grids: Mapping[str, TileGrid]  # the tile grid of every value the stage sends
    tile: int | None
    group: dist.ProcessGroup | None

    def tile_input(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's tile of a full input image (a copy)."""
        assert self.tile is not None
        return self.grid.tile(value, self.tile).contiguous()

    def tile_buffer(self, spec: ValueSpec, tile: int, device: torch.device) -> torch.Tensor:
        """A receive buffer for tile ``tile`` of an output value (or of its gradient)."""
        shape = (*spec.shape[:-2], *self.output_grids[spec.name].tile_shape(tile))
        return torch.empty(shape, dtype=spec.dtype, device=device)


def tiled_stages(plan: Plan, modules: Mapping[int, torch.fx.GraphModule], flow: Dataflow, rank: int,
                 timeout_s: float) -> dict[int, TiledStage]:
    """Every spatial stage, its grids checked against the dataflow; then creates the tile groups
    (collective: every rank creates every group, stage by stage, replica by replica)."""
    grids = {}
    for part in plan.stages:
        if part.spatial is not None:
            spec = part.spatial
            grid = TileGrid.build(spec.parts, spec.slicing.value, spec.height, spec.width)
            inputs = input_grids(plan, part.index, flow)
            outputs = _output_grids(part.index, modules[part.index], grid, inputs, flow)
            grids[part.index] = TiledStage(part.index, spec.halo, grid, inputs, outputs, None, None)
    timeout = datetime.timedelta(seconds=timeout_s)
    found = {}
    for stage, tiled in grids.items():
        for replica in range(plan.data_parallel):
            ranks = plan.layout.ranks_of(stage, replica)
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                tiled = dataclasses.replace(tiled, tile=ranks.index(rank), group=group)
        found[stage] = tiled
    return found


def input_grids(plan: Plan, stage: int, flow: Dataflow) -> dict[str, TileGrid]:
    """The tile grid of every image spatial stage ``stage`` receives, by input name (no communication).

    Stage 0 takes the model's inputs, each the spatial section's height x width image. A later
    spatial stage takes values from earlier spatial stages, each tiled over its own height and
    width with the stage's tile count and slicing; the section's height and width must be those
    of its first such input (its module's first positional one). Parameters and constants are not
    images and get no grid.
    """
    spec = plan.stages[stage].spatial
    assert spec is not None
    if stage == 0:
        grid = TileGrid.build(spec.parts, spec.slicing.value, spec.height, spec.width)
        _check_inputs(stage, grid, flow)
        return {name: grid for name in flow.data_inputs}
    io = flow.stages[stage]
    grids = {}
    for name in io.inputs:
        source, value = io.sources[name], flow.specs[name]
        if source.kind is not SourceKind.STAGE or not value.travels:
            continue
        if plan.stages[source.stage].spatial is None or value.kind is not ValueKind.TENSOR or len(value.shape) != 4:
            raise RuntimeSetupError(f"spatial stage {stage} receives {name} ({value.kind.value} {value.shape}) from "
                                    f"stage {source.stage}, which is not an image tile of an earlier spatial "
                                    f"stage; start the spatial stages at stage 0, one after the other")
        grids[name] = TileGrid.build(spec.parts, spec.slicing.value, *value.shape[-2:])
    first = next(iter(grids.items()), None)
    if first is None or (first[1].height, first[1].width) != (spec.height, spec.width):
        found = "no image" if first is None else f"{first[0]} of shape {flow.specs[first[0]].shape}"
        raise RuntimeSetupError(f"stage {stage} tiles a {spec.height}x{spec.width} image but its first input is "
                                f"{found}; make the spatial section's height and width those of the stage's "
                                f"first (N, C, H, W) input")
    return grids


def halo_bytes_sent(modules: Iterable[nn.Module]) -> int:
    """Bytes the halo exchanges inside ``modules`` have sent so far (their MessageCounters).

    Per micro-batch, each exchange sends forward the pixels of this rank's tile that its neighbours
    read (a per-layer conv/pool: cost_models.halo.halo_cost's ``bytes_sent``; a fused group: one
    exchange per value it reads, for a chain chain_halo_cost's) and, in the backward, the gradient
    of every halo it received (``recv_bytes``), except for a value that needs no gradient (the input
    image). An exchange inside a recomputed region sends its forward halo once more in the backward.
    Not counted: the tile join and the pipeline's other sends, and batch-norm all-reduces.
    """
    counts = [count_messages(module) for module in modules]
    return sum(count.forward_bytes + count.backward_bytes for count in counts)


def _check_inputs(stage: int, grid: TileGrid, flow: Dataflow) -> None:
    if flow.data_stage != stage:
        raise RuntimeSetupError(f"stage {stage} is spatial but the model's inputs enter on stage "
                                f"{flow.data_stage}; re-plan with the first stage spatial")
    for name in flow.data_inputs:
        shape = flow.specs[name].shape
        if len(shape) != 4 or tuple(shape[-2:]) != (grid.height, grid.width):
            raise RuntimeSetupError(f"stage {stage} tiles a {grid.height}x{grid.width} image but input "
                                    f"{name} has shape {shape}; make the spatial section's height and width "
                                    f"those of the (N, C, H, W) input")


def _output_grids(stage: int, module: torch.fx.GraphModule, grid: TileGrid, inputs: Mapping[str, TileGrid],
                  flow: Dataflow) -> dict[str, TileGrid]:
    """The grid of every value the stage sends (the spatial analysis of its module's output)."""
    graph = analyse(trace_spatial(module), grid, inputs)
    outputs = list(dict.fromkeys(graph.output.inputs))
    if len(outputs) != len(flow.stages[stage].outputs):
        raise RuntimeSetupError(f"stage {stage}'s module returns {len(outputs)} tiles but the dataflow "
                                f"expects {len(flow.stages[stage].outputs)} values")
    grids = {}
    for name, traced_name in zip(flow.stages[stage].outputs, outputs):
        node_grid = graph[traced_name].grid
        spec = flow.specs[name]
        if node_grid is None or spec.kind is not ValueKind.TENSOR or len(spec.shape) != 4:
            raise RuntimeSetupError(f"spatial stage {stage} sends {name} ({spec.kind.value} {spec.shape}), "
                                    f"which is not an (N, C, H, W) image tile; end the stage before it")
        grids[name] = node_grid
    for dst in flow.consumers(stage):
        stray = [name for name in flow.travelling((stage, dst)) if name not in grids]
        if stray:
            raise RuntimeSetupError(f"spatial stage {stage} passes {stray} on to stage {dst} without computing "
                                    f"them (a model input?), which this runtime cannot send from tiles; read "
                                    f"them on stage {stage} only")
    return grids
