"""plan(): trace, cost, search and solve, lower the schedule, simulate it, and return a Plan."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from cost_models.devices import DeviceSpec, get_device
from cost_models.memory import get_precision, optimizer_state_count
from cost_models.errors import InvalidArgument
from cost_models.graph.ir import LayerGraph, NodeKind
from planner.plan import (ClusterSpec, InputMeta, LayerRow, ModelRef, Plan, Prediction,
                          ScheduleKind, ScheduleSpec, SolverReport, StagePlan, StagePrediction,
                          TrainingSpec, Transfer, freeze)
from planner.simulation import sim_costs
from planner.schedules.actions import format_programs
from planner.schedules.generate import generate
from planner.schedules.lower import lower
from planner.schedules.simulate import SimResult, simulate
from planner.search.search import Candidate, Search, SearchResult, SearchSpace
from cost_models.graph.tracing import normalise_inputs, trace
from cost_models.units import format_ms, parse_mem_bytes

SUPPORTED_SCHEDULES = ("gpipe", "1f1b")


def plan(model: nn.Module, gpus: int, mem: str | int, *, batch_size: int,
         example_inputs: torch.Tensor | Sequence[torch.Tensor], device: str | DeviceSpec = "V100-16GB",
         gpus_per_node: int | None = None, optimizer: str = "adam", precision: str = "fp32",
         schedules: Sequence[str] = SUPPORTED_SCHEDULES, micro_batch_sizes: Sequence[int] | None = None,
         num_stages: Sequence[int] | None = None, time_limit_s: float = 60.0, builder: str | None = None,
         builder_kwargs: Mapping[str, Any] | None = None, leaf_modules: Sequence[type | str] = (),
         graph: LayerGraph | None = None) -> Plan:
    """Choose the fastest pipeline x data-parallel plan of ``model`` that fits ``mem`` per GPU.

    ``batch_size`` is the global batch per step; ``example_inputs`` only fix shapes (any batch
    dimension; meta tensors are fine). Costs are roofline estimates on ``device``.
    ``micro_batch_sizes`` and ``num_stages`` restrict the search (default: every divisor).

    Example::

        p = plan(resnet50(), gpus=16, mem="16GB", batch_size=256,
                 example_inputs=torch.empty(1, 3, 224, 224, device="meta"))
        print(p); p.save("plan.json")
    """
    inputs = normalise_inputs(example_inputs)
    space, spec = validate_space(gpus, mem, batch_size, device, gpus_per_node, optimizer, precision,
                                 schedules, micro_batch_sizes, time_limit_s, num_stages)
    graph = graph or trace(model, inputs, leaf_modules=leaf_modules)
    result = Search(graph, spec, space).run()
    return build_plan(graph, spec, space, result,
                      model_ref(graph, inputs, space, builder, builder_kwargs))


def model_ref(graph: LayerGraph, inputs: tuple[torch.Tensor, ...], space: SearchSpace,
              builder: str | None, builder_kwargs: Mapping[str, Any] | None) -> ModelRef:
    return ModelRef(builder, freeze(dict(builder_kwargs or {})), graph.fingerprint,
                    tuple(InputMeta(tuple(x.shape), str(x.dtype).removeprefix("torch."))
                          for x in inputs), space.precision.name)


def validate_space(gpus: int, mem: str | int, batch_size: int, device: str | DeviceSpec,
           gpus_per_node: int | None, optimizer: str, precision: str, schedules: Sequence[str],
           micro_batch_sizes: Sequence[int] | None, time_limit_s: float,
           num_stages: Sequence[int] | None = None) -> tuple[SearchSpace, DeviceSpec]:
    """Validate every argument before any tracing, with messages that name the value and fix."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise InvalidArgument(f"gpus must be a whole number >= 1, got {gpus!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgument(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    per_node = min(gpus, 8) if gpus_per_node is None else gpus_per_node
    if per_node < 1:
        raise InvalidArgument(f"gpus_per_node must be >= 1, got {gpus_per_node!r}")
    unknown = [s for s in schedules if s not in SUPPORTED_SCHEDULES]
    if unknown or not schedules:
        raise InvalidArgument(f"schedules {list(unknown or schedules)} not supported; choose from "
                              f"{', '.join(SUPPORTED_SCHEDULES)}")
    if micro_batch_sizes is not None and (not micro_batch_sizes or min(micro_batch_sizes) < 1):
        raise InvalidArgument(f"micro_batch_sizes must be positive, got {list(micro_batch_sizes)}")
    if num_stages is not None and (not num_stages or any(gpus % s for s in num_stages)):
        raise InvalidArgument(f"num_stages {list(num_stages or [])} must divide gpus={gpus}; "
                              f"choose from {[d for d in range(1, gpus + 1) if gpus % d == 0]}")
    spec = get_device(device)
    mode = get_precision(precision)
    optimizer_state_count(optimizer)
    space = SearchSpace(gpus, per_node, parse_mem_bytes(mem), batch_size, optimizer.lower(), mode,
                        tuple(dict.fromkeys(schedules)),
                        tuple(micro_batch_sizes) if micro_batch_sizes else None,
                        tuple(num_stages) if num_stages else None, time_limit_s=time_limit_s)
    return space, spec


def build_plan(graph: LayerGraph, device: DeviceSpec, space: SearchSpace, result: SearchResult,
               model: ModelRef) -> Plan:
    """Lower the winning configuration to programs, simulate them, and assemble the Plan."""
    best = result.best
    config = best.config
    stage_nodes = _stage_nodes(best)
    transfers = _transfers(best, graph, stage_nodes)
    schedule = generate(config.schedule, config.num_stages, config.num_microbatches)
    pipeline = lower(schedule.programs, schedule.stage_map,
                     {(t.src_stage, t.dst_stage) for t in transfers},
                     data_parallel=config.data_parallel > 1)
    ranks = [tuple(stage * config.data_parallel + replica for replica in range(config.data_parallel))
             for stage in range(config.num_stages)]
    stages = tuple(_stage_plan(best, index, nodes, ranks[index])
                   for index, nodes in enumerate(stage_nodes))
    simulated = simulate(pipeline, schedule.stage_map, sim_costs(stages, transfers, config.data_parallel))
    texts = format_programs(pipeline)
    per_rank = range(space.gpus)
    return Plan(
        model=model,
        cluster=ClusterSpec(space.gpus, space.gpus_per_node, freeze(device.to_dict()), space.mem_bytes),
        training=TrainingSpec(space.global_batch_size, config.micro_batch_size,
                              config.num_microbatches, space.optimizer),
        schedule=ScheduleSpec(ScheduleKind(config.schedule)),
        data_parallel=config.data_parallel,
        stages=stages,
        layers=tuple(LayerRow(c.name, c.fwd_ms, c.bwd_ms, c.param_bytes, c.saved_activation_bytes,
                              c.output_bytes) for c in best.table.costs),
        programs=tuple(texts[rank // config.data_parallel] for rank in per_rank),
        transfers=transfers,
        predicted=Prediction(simulated.step_ms, space.global_batch_size / simulated.step_ms * 1e3,
                             simulated.bubble_fraction,
                             tuple(simulated.peak_mem_bytes[rank // config.data_parallel] for rank in per_rank)),
        solver=_report(result, simulated),
    )


def _stage_nodes(best: Candidate) -> list[tuple[str, ...]]:
    units = best.coarsening.units
    return [tuple(name for unit in units[s.first_unit:s.last_unit + 1] for name in unit.nodes)
            for s in best.evaluation.stages]


def _transfers(best: Candidate, graph: LayerGraph, stage_nodes: list[tuple[str, ...]]) -> tuple[Transfer, ...]:
    """Bytes each stage sends each later stage per micro-batch (skip connections included)."""
    stage_of = {name: index for index, names in enumerate(stage_nodes) for name in names}
    sent: dict[tuple[int, int], int] = {}
    for node in graph:
        if node.kind is NodeKind.PARAM:
            continue
        for target in {stage_of[user] for user in graph.users[node.name]} - {stage_of[node.name]}:
            edge = (stage_of[node.name], target)
            sent[edge] = sent.get(edge, 0) + best.table[node.name].output_bytes
    return tuple(Transfer(src, dst, nbytes, best.problem.links[src].ms(nbytes))
                 for (src, dst), nbytes in sorted(sent.items()))


def _stage_plan(best: Candidate, index: int, nodes: tuple[str, ...], ranks: tuple[int, ...]) -> StagePlan:
    summary = best.evaluation.stages[index]
    in_flight = best.problem.in_flight[index]
    allreduce_ms = summary.allreduce_ms if best.config.data_parallel > 1 else 0.0
    return StagePlan(index, ranks, nodes, StagePrediction(
        summary.fwd_ms, summary.bwd_ms, sum(best.table[name].param_bytes for name in nodes),
        in_flight * summary.activation_bytes, summary.peak_mem_bytes, in_flight, allreduce_ms))


def _report(result: SearchResult, simulated: SimResult) -> SolverReport:
    best, runner_up = result.best, result.runner_up
    if best.solver == "manual split":
        return SolverReport(best.solver, best.status.value, best.objective_ms, 0.0, result.wall_s, 1,
                            f"split given by the user: {best.config.describe()}; not searched",
                            f"simulated step {format_ms(simulated.step_ms)}")
    why = f"{best.config.describe()} has the lowest predicted step ({format_ms(best.objective_ms)})"
    runner = None
    if runner_up is not None:
        why += (f"; runner-up {runner_up.config.describe()} at {format_ms(runner_up.objective_ms)} "
                f"({runner_up.objective_ms / best.objective_ms:.2f}x)")
        runner = freeze({"num_stages": runner_up.config.num_stages,
                         "data_parallel": runner_up.config.data_parallel,
                         "micro_batch_size": runner_up.config.micro_batch_size,
                         "schedule": runner_up.config.schedule, "step_ms": runner_up.objective_ms})
    why += (f"; {result.configs_solved} of {result.configs_total} configurations solved, the rest "
            f"could not fit the memory or could not beat it (lower bound)")
    slowest = max(best.evaluation.stages, key=lambda s: s.compute_ms)
    binding = (f"{best.binding}; bottleneck stage {best.evaluation.stages.index(slowest)} "
               f"({format_ms(slowest.compute_ms)} per micro-batch); simulated step "
               f"{format_ms(simulated.step_ms)}")
    return SolverReport(best.solver, best.status.value, best.objective_ms, best.gap, result.wall_s,
                        result.configs_total, why, binding, runner)
