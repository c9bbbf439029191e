"""Consecutive spatial stages (now-dl's ``--num-spatial-parts 4,2``) equal a single-process float64 run.

ResNet-50 (width 4, 64x64 images, float64): stage 0 = the stem and layer1 on 4 square tiles,
stage 1 = layer2 and layer3's first block on 2 vertical strips, then the rest as one ordinary
stage (7 ranks), under GPipe and 1F1B (recomputing and swapping on the strips); stage 1 receives
layer1's 16x16 output re-tiled from the square tiles onto strips. And a cut inside a residual
block with three spatial stages (2 horizontal, 2 vertical, 2 horizontal tiles, 1F1B): layer1's output skips stage 1 to the shortcut
on stage 2, which takes it as 16x16 strips beside stage 1's 8x8 output (two images, each tiled
over its own size). Losses, every gradient, the final weights and the batch-norm running
statistics equal the reference to 1e-10 of each tensor's largest entry (as
tests/dist/test_spatial_runtime.py explains), and every rank's halo bytes are what
cost_models.halo gives for its stage's conv and pool layers on its tile: the re-tiling between
spatial stages is not halo traffic. A fourth case is the search's own plan for 7 ranks in 3 stages
(4 tiles, then 2, then one rank, wherever the ILP cuts and whichever halo groups it fuses): it
equals the reference too, and each tile's halo bytes are the plan's prediction.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import pytest
import torch
import torch.fx
from torch import nn

from cost_models.graph.ir import Geometry
from cost_models.halo import Edges, balanced_edges, halo_cost, output_edges, windows_of
from cost_models.presets import PRESETS
from planner.plan import OffloadSpec, Plan, SpatialSpec
from runtime.build import default_dtype, rebuild_model, trace_checked
from runtime.values import ValueSpec, value_specs
from tests.dist.harness import run_ranks
from tests.dist.runtime_cases import Case, Outcome, reference, run_cases
from tests.dist.test_spatial_runtime import assert_rank_equals
from tests.runtime_plans import RESNET, make_plan

pytestmark = pytest.mark.dist


Cut = tuple[list[str], dict[int, SpatialSpec]]  # stage starts, spatial sections
FOUR_THEN_TWO: Cut = (["layer2_0_conv1", "layer3_1_conv1"],
                      {0: SpatialSpec(4, "square", "per-layer", height=64, width=64),
                       1: SpatialSpec(2, "vertical", "per-layer", height=16, width=16)})
SKIPPING: Cut = (["layer2_0_conv1", "layer2_0_bn2", "layer2_1_conv1"],
                 {0: SpatialSpec(2, "horizontal", "per-layer", height=64, width=64),
                  1: SpatialSpec(2, "vertical", "per-layer", height=16, width=16),
                  2: SpatialSpec(2, "horizontal", "per-layer", height=8, width=8)})  # first input: conv2's 8x8
# On stage 1's strips: a recomputed strided conv (its halo exchanged again in the backward) and swapped nodes.
ON_STRIPS = OffloadSpec(recompute=(("layer2_0_conv2", "layer2_0_bn2", "layer2_0_relu2"),),
                        swap=("layer2_1_conv2", "layer2_1_bn2"))


@dataclass(frozen=True)
class _Grid:
    row_edges: Edges
    col_edges: Edges


def _plan(cut: Cut, schedule: str, offload: list[OffloadSpec] | None = None) -> str:
    return make_plan(RESNET, cut[0], schedule=schedule, microbatches=2, spatial=cut[1], offload=offload)


def _check(plan: Plan, expected: Outcome, by_rank: list[Outcome], halo_bytes: list[int] | None) -> None:
    """Every rank's losses, and the gradients, weights and buffers of its stage, equal the reference;
    its stage recomputed and swapped what the plan says; its halo bytes are ``halo_bytes`` (the
    per-layer count; None for a plan with fused halo groups, checked against the plan's own prediction)."""
    seen: set[str] = set()
    for rank, outcome in enumerate(by_rank):
        assert_rank_equals(rank, outcome, expected)
        seen |= set(outcome.grads)
        offload = plan.stages[plan.layout.stages_of_rank(rank)[0]].offload
        assert outcome.checkpointed == len(offload.recompute), f"rank {rank} checkpointed regions"
        assert (outcome.swapped_bytes > 0) == bool(offload.swap), f"rank {rank} swapped bytes"
    assert seen == set(expected.grads), f"parameters on no rank: {sorted(set(expected.grads) - seen)}"
    if halo_bytes is not None:
        assert [outcome.halo_bytes_sent for outcome in by_rank] == halo_bytes


def _predicted_halo_bytes(plan: Plan, traced: torch.fx.GraphModule, shapes: Mapping[str, ValueSpec]) -> list[int]:
    """What each rank's halo exchanges send in one step, from cost_models.halo, layer by layer.

    A spatial stage's tile edges for an image size it receives are balanced over that size; a
    strided layer's output edges follow the ownership rule (output_edges; ResNet's strided layers
    into one size, 3x3 pad 1 and 1x1 pad 0, agree on them). Per micro-batch each conv/pool sends
    forward the pixels its neighbours read (again when recomputed) and, in the backward, the
    gradient of every halo it received, except where it reads the input image, which needs no
    gradient. Ordinary ranks send none. ``shapes``: every node's value at the micro-batch size.
    """
    nodes = {node.name: node for node in traced.graph.nodes}
    sent = [0] * plan.layout.world_size
    for stage in plan.stages:
        spec = stage.spatial
        if spec is None:
            continue
        rows, cols = spec.grid_shape
        edges: dict[int, _Grid] = {}
        for name in stage.nodes:
            node = nodes[name]
            layer = traced.get_submodule(str(node.target)) if node.op == "call_module" else None
            if not isinstance(layer, (nn.Conv2d, nn.MaxPool2d)):
                continue
            source = node.args[0].name  # type: ignore[union-attr]
            size, channels = shapes[source].shape[-1], shapes[source].shape[1]
            grid = edges.setdefault(size, _Grid(balanced_edges(size, rows), balanced_edges(size, cols)))
            geometry = _geometry(layer)
            row, col = windows_of(geometry)
            after = _Grid(output_edges(grid.row_edges, row), output_edges(grid.col_edges, col))
            edges.setdefault(after.row_edges[-1], after)
            forwards = 2 if name in stage.offload.recomputed_nodes else 1
            for replica in range(plan.data_parallel):
                for tile, rank in enumerate(plan.layout.ranks_of(stage.index, replica)):
                    cost = halo_cost(geometry, grid, tile, channels=channels, dtype_bytes=8,
                                     batch=plan.training.micro_batch_size, link=PRESETS["V100-16GB"].intra_node)
                    gradients = sum(nbytes for _, nbytes in cost.recv_bytes) if source != "x" else 0
                    sent[rank] += (forwards * cost.bytes_sent + gradients) * plan.training.num_microbatches
    return sent


def _geometry(layer: nn.Conv2d | nn.MaxPool2d) -> Geometry:
    def pair(value: int | tuple[int, ...]) -> tuple[int, int]:
        return (value, value) if isinstance(value, int) else (value[0], value[1])

    op = "conv" if isinstance(layer, nn.Conv2d) else "max_pool"
    return Geometry(op, pair(layer.kernel_size), pair(layer.stride), pair(layer.padding),  # type: ignore[arg-type]
                    pair(layer.dilation))


def test_spatial_stages_one_after_another_equal_a_single_process() -> None:
    """4 square tiles then 2 vertical strips (GPipe; 1F1B recomputing and swapping on the strips);
    three spatial stages with a value skipping one (1F1B, ZB-H1)."""
    cases = [Case(_plan(FOUR_THEN_TWO, "gpipe"), steps=1),
             Case(_plan(FOUR_THEN_TWO, "1f1b", offload=[OffloadSpec(), ON_STRIPS, OffloadSpec()]), steps=1),
             Case(_plan(SKIPPING, "1f1b"), steps=1), Case(_searched(), steps=1),
             Case(_plan(SKIPPING, "zb-h1"), steps=1)]  # I sends the halos' gradients on stages 1 and 2
    outcomes = run_ranks(run_cases, 7, cases, timeout_s=240)
    expected = reference(cases[0])  # the model, batch and optimizer are the same in every case
    plans = [Plan.from_dict(json.loads(case.plan_json)) for case in cases]
    traced = trace_checked(rebuild_model(plans[0]), plans[0])
    inputs = [(meta.shape, getattr(torch, meta.dtype)) for meta in plans[0].model.example_inputs]
    shapes = value_specs(traced, inputs, plans[0].training.micro_batch_size)
    for index, plan in enumerate(plans):
        fused = any(stage.spatial is not None and stage.spatial.fused_groups for stage in plan.stages)
        _check(plan, expected, [outcomes[rank][index] for rank in range(7)],
               None if fused else _predicted_halo_bytes(plan, traced, shapes))
    searched = plans[3]  # the planner's own prediction of every tile's halo bytes is the runtime's count too
    assert [stage.spatial.parts for stage in searched.stages[:2]] == [4, 2]  # type: ignore[union-attr]
    predicted = [0] * 7
    for stage in searched.stages[:2]:
        for tile, rank in enumerate(searched.layout.ranks_of(stage.index, 0)):
            predicted[rank] = stage.spatial.halo_bytes[tile] * searched.training.num_microbatches  # type: ignore[union-attr]
    assert [outcomes[rank][3].halo_bytes_sent for rank in range(7)] == predicted


def _searched() -> str:
    """The search's plan for 7 GPUs in 3 stages of 1 replica, which only 4 tiles, then 2, then one rank
    can use (planner.plan(), float64, the batches and optimizer of make_plan's plans)."""
    from cost_models.graph.model_spec import build_model, load_builder
    from planner import plan

    kwargs = {"width": 4, "num_classes": 10}
    with default_dtype(torch.float64):
        model = build_model(load_builder(RESNET), kwargs, "meta")
    return plan(model, gpus=7, mem="16GB", batch_size=4, micro_batch_sizes=(2,), num_stages=(3,), data_parallel=(1,),
                schedules=("1f1b",), precision="fp64", optimizer="momentum", offload=False, builder=RESNET,
                builder_kwargs=kwargs,
                example_inputs=torch.empty(1, 3, 64, 64, dtype=torch.float64, device="meta")).to_json()
