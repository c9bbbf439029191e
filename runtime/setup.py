"""Everything a rank prepares once, before its first step: checks, stages, groups.

Order (no collective runs before the checks that every rank makes alike):
plan layout and world size -> this rank's program -> rebuild check (fingerprint) -> split ->
dataflow at the micro-batch size -> the NVMe directory (if the plan pages optimizer state) ->
materialise this rank's stages -> process groups -> optimizers (ZeRO shards over the
data-parallel groups) -> a world-wide check that every rank loaded the same plan.
"""

from __future__ import annotations

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
from planner.schedules import Action
from runtime import build, checks
from runtime.dataflow import Dataflow, check_edges, dataflow
from runtime.grads import Groups, create_groups
from runtime.nvme import PagedFile
from runtime.sharding import ShardGroup
from runtime.stage_optimizer import StageOptimizer
from runtime.stages import LocalStage, OptimizerFactory, local_stages, param_targets, stage_param_names
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


def set_up(plan: Plan, model: nn.Module, optimizer_factory: OptimizerFactory, *, seed: int,
           device: torch.device, timeout_s: float, leaf_modules: Sequence[LeafSpec],
           nvme_dir: Path | None = None) -> RankSetup:
    """Check the plan against the job and the model, then build this rank's stages (collective)."""
    rank = dist.get_rank()
    checks.check_plan(plan)
    checks.check_executable(plan)
    checks.check_world_size(plan, dist.get_world_size())
    segments = checks.segments(checks.rank_program(plan, rank))
    stage_ids, replica = checks.my_stages(plan, rank)
    check_nvme_dir(plan, nvme_dir, stage_ids)
    traced = build.trace_checked(model, plan, leaf_modules)
    modules = build.split_stages(traced, model, plan)
    inputs = [(meta.shape, getattr(torch, meta.dtype)) for meta in plan.model.example_inputs]
    specs = value_specs(traced, inputs, plan.training.micro_batch_size)
    flow = dataflow(traced, modules, plan.part_of(), specs)
    check_edges(flow, {(t.src_stage, t.dst_stage) for t in plan.transfers})
    stage_params = stage_param_names(model, modules, flow)
    materialise(model, modules, flow, stage_ids, seed, device)
    stages = local_stages(model, modules, flow, stage_ids)
    groups = create_groups(plan.layout, rank, stage_params, timeout_s)
    for stage in stages.values():
        stage.state = stage_optimizer(plan, stage, optimizer_factory, groups, device=device,
                                      timeout_s=timeout_s, nvme_dir=nvme_dir)
    check_same_plan(plan)
    return RankSetup(segments, stage_ids, replica, traced, flow, stages, groups)


def materialise(model: nn.Module, modules: Mapping[int, torch.fx.GraphModule], flow: Dataflow,
                stage_ids: Sequence[int], seed: int, device: torch.device) -> None:
    """Give this rank's stages real weights: initialised from meta, or moved if already real."""
    def tensors(stage: int) -> list[torch.Tensor]:
        return build.stage_tensors(modules[stage], model, param_targets(flow.stages[stage]))

    mine = [t for stage in stage_ids for t in tensors(stage)]
    holders = build.holder_modules(model, mine)
    if build.on_meta(mine):
        initialize(model, seed, device=device, modules=holders)
    else:
        for name in sorted(holders):
            model.get_submodule(name)._apply(lambda t: t.to(device), recurse=False)
    for stage in stage_ids:
        build.check_materialised(stage, tensors(stage), device)


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
                    device: torch.device, timeout_s: float, nvme_dir: Path | None) -> StageOptimizer | None:
    """The stage's optimizer where its offload section puts it (None if it owns no parameter)."""
    if not stage.params:
        return None
    spec = plan.stages[stage.index].offload
    group = groups.data_parallel.get(plan.layout.part(stage.index))
    shards = ShardGroup(group, timeout_s) if spec.zero_stage and group is not None else None
    pager = None
    if spec.optimizer_state is StateTier.NVME:
        assert nvme_dir is not None  # check_nvme_dir refused its absence
        pager = PagedFile(nvme_dir / f"rank{dist.get_rank()}-stage{stage.index}.optim", timeout_s)
    return StageOptimizer(stage.index, stage.params, factory, spec=spec, device=device, shards=shards,
                          replicated=groups.tied_names, pager=pager)
