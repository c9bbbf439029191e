"""plan_with_split(): a Plan for a split the user chose (GEMS' --balance), costed like any other."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from cost_models.devices import DeviceSpec
from cost_models.errors import InvalidArgument
from cost_models.estimation import model_precision
from cost_models.graph.ir import LayerGraph
from cost_models.graph.tracing import normalise_inputs, trace
from cost_models.memory import Optimizer, Precision
from planner.api import model_ref, validate_space
from planner.assemble import build_plan
from planner.plan import OffloadSpec, Plan, ScheduleKind
from planner.search.evaluate import evaluate
from planner.search.ilp import SolveStatus
from planner.search.problem import group_units
from planner.search.search import Candidate, Config, Search, SearchResult


def plan_with_split(model: nn.Module, *, example_inputs: torch.Tensor | Sequence[torch.Tensor],
                    stage_starts: Sequence[str], batch_size: int, micro_batch_size: int,
                    data_parallel: int = 1, schedule: str | ScheduleKind = "1f1b",
                    device: str | DeviceSpec = "V100-16GB", mem: str | int = "1TB",
                    gpus_per_node: int | None = None, optimizer: str | Optimizer = "adam",
                    precision: str | Precision | None = None, builder: str | None = None,
                    builder_kwargs: Mapping[str, Any] | None = None,
                    graph: LayerGraph | None = None,
                    offload: Sequence[OffloadSpec] | None = None) -> Plan:
    """A plan whose stage s + 1 begins at node ``stage_starts[s]`` (stage 0 at the first node).

    Costs, programs and predictions are made exactly as for a solved plan, so a manual split
    can be compared with tessera's and run by the same runtime. ``offload`` (one per stage) forces
    the stages' memory decisions (checkpoint regions, swapped nodes, ZeRO stage, tiers) instead of
    keeping everything on the GPU.

    Example::

        p = plan_with_split(model, example_inputs=x, stage_starts=["layer3_0_conv1"],
                            batch_size=8, micro_batch_size=2)
    """
    inputs = normalise_inputs(example_inputs)
    graph = graph or trace(model, inputs)
    num_stages = len(stage_starts) + 1
    if batch_size % (data_parallel * micro_batch_size):
        raise InvalidArgument(f"batch size {batch_size} is not a multiple of data_parallel "
                              f"{data_parallel} x micro_batch_size {micro_batch_size}")
    space, spec = validate_space(num_stages * data_parallel, mem, batch_size, device, gpus_per_node,
                                 optimizer, precision or model_precision(graph), (schedule,),
                                 (micro_batch_size,), time_limit_s=60.0)  # unused: nothing is searched
    config = Config(num_stages, data_parallel, micro_batch_size,
                    batch_size // (data_parallel * micro_batch_size), space.schedules[0])
    search = Search(graph, spec, space)
    table, _ = search.costs(micro_batch_size)
    coarse = group_units(graph, table, space.precision, space.optimizer, _starts(graph, stage_starts))
    setup = search.setup(config, coarse)
    cuts = tuple(range(num_stages - 1))
    evaluation = evaluate(setup.costs, cuts)
    if offload is not None:
        if len(offload) != num_stages:
            raise InvalidArgument(f"offload lists {len(offload)} stage decisions but the split has "
                                  f"{num_stages} stages; give one OffloadSpec per stage")
        evaluation = dataclasses.replace(evaluation, offload=tuple(offload))
    candidate = Candidate(setup, evaluation, evaluation.step_ms, SolveStatus.OPTIMAL, "manual split", 0.0, "")
    result = SearchResult(candidate, None, 1, 1, 0.0)
    return build_plan(graph, spec, space, result, model_ref(graph, inputs, space, builder, builder_kwargs))


def _starts(graph: LayerGraph, stage_starts: Sequence[str]) -> list[int]:
    position = {node.name: index for index, node in enumerate(graph)}
    unknown = [name for name in stage_starts if name not in position]
    if unknown:
        raise InvalidArgument(f"stage_starts {unknown} are not nodes of the traced graph; use names "
                              f"from trace(model, inputs) such as {list(position)[1:4]}")
    starts = [position[name] for name in stage_starts]
    if starts != sorted(set(starts)) or (starts and starts[0] == 0):  # none: one stage
        raise InvalidArgument(f"stage_starts must be distinct nodes after the first, in graph order; "
                              f"got {list(stage_starts)} at positions {starts}")
    return starts
