"""Everything a rank prepares once, before its first step: checks, stages, groups.

Order (no collective runs before the checks that every rank makes alike):
plan layout and world size -> this rank's program -> rebuild check (fingerprint) -> split ->
dataflow at the micro-batch size -> every stage's checkpoint regions and swapped nodes, a spatial
stage's fused groups (on the tiling of the images it receives) -> the NVMe directory (if the plan
pages optimizer state) -> materialise this rank's stages -> the spatial stages' tile groups ->
under mixed precision: fp32 copies of the weights, then the model cast to 16 bits and the value
specs taken again, so that 16-bit activations travel -> recompute and swap wrapped around this
rank's stages (a spatial stage put on its tile in the same pass) -> process groups -> optimizers
(runtime/stage_optimizer.py: masters on the plan's tier, ZeRO shards over the data-parallel
groups; under mixed precision the fp32 masters start from those copies, and MixedPrecision holds
the loss scale) -> a world-wide check that every rank loaded the same plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from cost_models.errors import RuntimeSetupError
from cost_models.graph.capture import LeafSpec
from planner.nvme_dir import check_nvme_dir
from planner.plan import Plan, StateTier
from planner.schedules import Action, ActionKind
from runtime import build, checks
from runtime.dataflow import Dataflow, check_edges, dataflow
from runtime.grads import Groups, create_groups
from runtime.layer_gathers import gathered_layers
from runtime.memory import storage_key
from runtime.nvme import PagedFile
from runtime.offload import check_offload, offload_stage
from runtime.precision import MixedPrecision, ScalerOptions, cast_model, compute_dtype, fp32_copies
from runtime.sharding import ShardGroup
from runtime.spatial_stage import check_spatial_stage, tile_stage
from runtime.stage_optimizer import StageOptimizer
from runtime.stages import LocalStage, OptimizerFactory, local_stages, param_targets, stage_param_names
from runtime.swap import SwapSpace
from runtime.tiles import TiledStage, input_grids, tiled_stages
from runtime.values import value_specs
from runtime.weights import initialize


@dataclass
class RankSetup:
    """This rank's share of the plan, ready to run."""

    segments: list[Action | tuple[Action, ...]]  # the program, communication runs grouped
    stage_ids: tuple[int, ...]
    replica: int
    traced: torch.fx.GraphModule
    flow: Dataflow
    stages: dict[int, LocalStage]
    groups: Groups
    swaps: SwapSpace  # the saved activations this rank's stages swap to the host
    mixed: MixedPrecision | None  # fp16/bf16: the fp32 masters and the loss scale
    tiled: dict[int, TiledStage]  # every spatial stage (its tile and group where this rank runs it)


def set_up(plan: Plan, model: nn.Module, optimizer_factory: OptimizerFactory, *, seed: int,
           device: torch.device, timeout_s: float, leaf_modules: Sequence[LeafSpec],
           loss_scale: ScalerOptions | None = None, nvme_dir: Path | None = None) -> RankSetup:
    """Check the plan against the job and the model, then build this rank's stages (collective).

    ``loss_scale`` is the fp16 loss scale's rule (default: ``torch.amp.GradScaler``'s);
    ``nvme_dir`` where stages whose optimizer state the plan puts on NVMe page it.
    """
    rank = dist.get_rank()
    checks.check_plan(plan)
    checks.check_executable(plan)
    checks.check_world_size(plan, dist.get_world_size())
    segments = checks.segments(checks.rank_program(plan, rank))
    stage_ids, replica = checks.my_stages(plan, rank)
    parts = {stage: plan.layout.part(stage) for stage in stage_ids}
    check_nvme_dir(plan, nvme_dir, plan.layout.parts_of_rank(rank))
    traced = build.trace_checked(model, plan, leaf_modules)
    modules = build.split_stages(traced, model, plan)
    inputs = [(meta.shape, getattr(torch, meta.dtype)) for meta in plan.model.example_inputs]
    specs = value_specs(traced, inputs, plan.training.micro_batch_size)
    flow = dataflow(traced, modules, plan.part_of(), specs)
    for stage, module in modules.items():
        check_offload(module, plan.stages[stage].offload, stage=stage)
        spatial = plan.stages[stage].spatial
        if spatial is not None:
            check_spatial_stage(module, spatial, plan.stages[stage].offload, input_grids(plan, stage, flow),
                                stage=stage)
    check_edges(flow, {(t.src_stage, t.dst_stage) for t in plan.transfers})
    stage_params = stage_param_names(model, modules, flow)
    materialise(model, modules, flow, plan.layout.parts_of_rank(rank), seed, device)
    precision = plan.model.precision
    stages = local_stages(model, modules, flow, parts)
    tiled = tiled_stages(plan, modules, flow, rank, timeout_s)  # collective: the tile groups
    sources: dict[int, list[torch.Tensor]] = {}
    if precision.master_weights:
        sources = fp32_copies(stages)  # the masters' start, before the cast rounds the weights
        flow = to_16_bits(model, traced, flow, plan, inputs)
    swaps = offload_activations(plan, stages, tiled, device, timeout_s)  # after the cast: it keys the
    # parameters' storages
    groups = create_groups(plan.layout, rank, stage_params, timeout_s)
    for stage in stages.values():
        stage.state = stage_optimizer(plan, stage, optimizer_factory, groups, device=device,
                                      timeout_s=timeout_s, nvme_dir=nvme_dir, sources=sources.get(stage.index))
        if stage.state is not None:
            gathered_layers(stage.module, stage.state, stage.attrs.values(), stage.params,  # ZeRO-3: by layer
                            plan.stages[stage.part].offload, stage=stage.index)
    mixed = None
    if precision.master_weights:
        stepped = {a.stage for a in segments if isinstance(a, Action) and a.kind is ActionKind.OPTIMIZER_STEP}
        mixed = MixedPrecision(precision, {i: stage.state for i, stage in stages.items()}, stepped=stepped,
                               device=device, timeout_s=timeout_s, scaler=loss_scale)
    check_same_plan(plan)
    return RankSetup(segments, stage_ids, replica, traced, flow, stages, groups, swaps, mixed, tiled)


def offload_activations(plan: Plan, stages: Mapping[int, LocalStage], tiled: Mapping[int, TiledStage],
                        device: torch.device, timeout_s: float) -> SwapSpace:
    """Wrap recompute and swap around this rank's stage modules (after materialisation, so the
    swap hooks know the real parameters and buffers, which are never swapped); a spatial stage's
    module is put on this rank's tile in the same pass (runtime/spatial_stage.py)."""
    state = [t for stage in stages.values() for t in [*stage.module.parameters(), *stage.module.buffers(),
                                                       *stage.attrs.values()]]
    swaps = SwapSpace(device, {storage_key(t) for t in state})
    for stage in stages.values():
        part = plan.stages[stage.part]
        if stage.index in tiled:
            assert part.spatial is not None
            on_tile = tile_stage(stage.module, tiled[stage.index], part.spatial, part.offload, swaps,
                                 timeout_s=timeout_s)
            stage.module = on_tile  # type: ignore[assignment]
        else:
            stage.module = offload_stage(stage.module, part.offload, swaps, stage=stage.index)
    return swaps


def to_16_bits(model: nn.Module, traced: torch.fx.GraphModule, flow: Dataflow, plan: Plan,
               inputs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> Dataflow:
    """Cast the model (meta parts too) to the plan's 16-bit dtype; the dataflow with the value
    specs taken again, so that activations and their gradients travel in 16 bits."""
    cast_model(model, plan.model.precision)
    dtype = compute_dtype(plan.model.precision)
    cast = [(shape, dtype if given.is_floating_point else given) for shape, given in inputs]
    return dataclasses.replace(flow, specs=value_specs(traced, cast, plan.training.micro_batch_size))


def materialise(model: nn.Module, modules: Mapping[int, torch.fx.GraphModule], flow: Dataflow,
                parts: Sequence[int], seed: int, device: torch.device) -> None:
    """Give this rank's parts real weights: initialised from meta, or moved if already real."""
    def tensors(part: int) -> list[torch.Tensor]:
        return build.stage_tensors(modules[part], model, param_targets(flow.stages[part]))

    mine = [t for part in parts for t in tensors(part)]
    holders = build.holder_modules(model, mine)
    if build.on_meta(mine):
        initialize(model, seed, device=device, modules=holders)
    else:
        for name in sorted(holders):
            model.get_submodule(name)._apply(lambda t: t.to(device), recurse=False)
    for part in parts:
        build.check_materialised(part, tensors(part), device)


def check_same_plan(plan: Plan) -> None:
    """Every rank loaded the same plan (a world collective, which also precedes any P2P)."""
    programs = hashlib.sha256(repr(plan.programs).encode()).hexdigest()[:16]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (plan.model.fingerprint, programs))
    if len(set(everyone)) != 1:
        raise RuntimeSetupError(f"ranks loaded different plans (fingerprint, programs hash by rank: "
                                f"{everyone}); give every rank the same plan file",
                                same_on_every_rank=False)


def stage_optimizer(plan: Plan, stage: LocalStage, factory: OptimizerFactory, groups: Groups, *,
                    device: torch.device, timeout_s: float, nvme_dir: Path | None,
                    sources: Sequence[torch.Tensor] | None = None) -> StageOptimizer | None:
    """The stage's optimizer where its offload section puts it (None if it owns no parameter)."""
    if not stage.params:
        return None
    spec = plan.stages[stage.part].offload
    group = groups.data_parallel.get(stage.part)
    shards = ShardGroup(group, timeout_s) if spec.zero_stage and group is not None else None
    pager = None
    if spec.optimizer_state is StateTier.NVME:
        assert nvme_dir is not None  # check_nvme_dir refused its absence
        pager = PagedFile(nvme_dir / f"rank{dist.get_rank()}-stage{stage.index}.optim", timeout_s)
    return StageOptimizer(stage.index, stage.params, factory, spec=spec, device=device, shards=shards,
                          replicated=groups.tied_names, pager=pager, sources=sources)
