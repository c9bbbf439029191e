"""plan_with_split(): a Plan for a split the user chose (GEMS' --balance), costed like any other;
reschedule(): a plan's parts under another schedule family."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from cost_models.devices import DeviceSpec, get_device
from cost_models.errors import InvalidArgument, PlanFileError
from cost_models.estimation import model_precision
from cost_models.graph.ir import LayerGraph
from cost_models.graph.tracing import normalise_inputs, trace
from cost_models.memory import Optimizer, Precision
from planner.api import (
    measures,
    model_ref,
    node_measure,
    validate_space,
    warn_about_budget,
    warn_shared_cores,
)
from planner.assemble import build_plan
from planner.plan import (
    Layout,
    OffloadSpec,
    Plan,
    Prediction,
    ScheduleKind,
    ScheduleSpec,
    SpatialSpec,
    StagePlan,
    check_invariants,
)
from planner.schedules import Schedule, format_programs, generate, lower, max_in_flight, simulate, validate
from planner.schedules.swaps import insert_swaps
from planner.search.evaluate import evaluate
from planner.search.ilp import SolveStatus
from planner.search.problem import (
    group_units,
    part_allreduces,
    staying_values,
    tied_sum_over,
    untied_allreduce_ms,
)
from planner.search.search import Candidate, Config, Search, SearchResult
from planner.simulation import sim_costs


def plan_with_split(model: nn.Module, *, example_inputs: torch.Tensor | Sequence[torch.Tensor],
                    stage_starts: Sequence[str], batch_size: int, micro_batch_size: int,
                    data_parallel: int = 1, schedule: str | ScheduleKind = "1f1b",
                    device: str | DeviceSpec = "V100-16GB", mem: str | int | None = None,
                    gpus_per_node: int | None = None, optimizer: str | Optimizer = "adam",
                    precision: str | Precision | None = None, builder: str | None = None,
                    builder_kwargs: Mapping[str, Any] | None = None,
                    graph: LayerGraph | None = None,
                    offload: Sequence[OffloadSpec] | None = None,
                    spatial: Mapping[int, SpatialSpec] | None = None, profile: bool | None = None,
                    virtual_stages: int | None = None, leaf_modules: Sequence[type | str] = (),
                    allow_stale_weights: bool = False) -> Plan:
    """A plan whose stage s + 1 begins at node ``stage_starts[s]`` (stage 0 at the first node).

    Costs, programs and predictions are made exactly as for a solved plan, so a manual split
    can be compared with tessera's and run by the same runtime. ``offload`` (one per stage) forces
    the stages' memory decisions (checkpoint regions, swapped nodes, ZeRO stage, tiers) instead of
    keeping everything on the GPU; they are recorded and executed as given, but the predictions stay
    those of the split with everything kept on the GPU (the search costs only its own decisions).
    ``spatial`` (stage -> SpatialSpec) runs those stages on ``parts`` ranks each, one image tile per
    rank (the plan needs that many more GPUs); the predictions stay those of the non-spatial split,
    one rank per stage (the cost of tiles and halos is not modelled here yet). ``profile`` as in
    :func:`planner.plan`: on ``device="cpu"`` a model with real weights is costed from node times
    measured on this CPU. ``mem``, each GPU's budget, is warned about as :func:`planner.plan` does (above the
    device's memory; CPU ranks sharing this machine's memory or cores); without it the plan is measured against
    the device's memory, and nothing is warned about or refused. A family holding
    several parts per rank puts ``virtual_stages`` of them on each (``leaf_modules``: those ``graph`` was traced
    with, recorded for the runtime):
    interleaved 1F1B as many as given (default 2), WPipe 2 (one of each group), every other family 1; the plan
    then uses (parts / virtual_stages) x ``data_parallel`` GPUs. WPipe, which trains its first group on weights
    one update old, needs ``allow_stale_weights=True``, as in :func:`planner.plan`.

    Example::

        p = plan_with_split(model, example_inputs=x, stage_starts=["layer3_0_conv1"],
                            batch_size=8, micro_batch_size=2)
    """
    inputs = normalise_inputs(example_inputs)
    graph = graph or trace(model, inputs, leaf_modules=leaf_modules)
    num_stages = len(stage_starts) + 1
    if batch_size % (data_parallel * micro_batch_size):
        raise InvalidArgument(f"batch size {batch_size} is not a multiple of data_parallel "
                              f"{data_parallel} x micro_batch_size {micro_batch_size}")
    try:
        kind = ScheduleKind.parse(schedule)
    except ValueError as error:
        raise InvalidArgument(str(error)) from None
    per_rank = _parts_per_rank(kind, num_stages, virtual_stages)
    budget = get_device(device).mem_bytes if mem is None else mem
    space, spec = validate_space(num_stages // per_rank * data_parallel, budget, batch_size, device, gpus_per_node,
                                 optimizer, precision or model_precision(graph), (schedule,), (micro_batch_size,),
                                 time_limit_s=60.0,  # unused: nothing is searched
                                 allow_stale_weights=allow_stale_weights)
    if mem is not None:
        warn_about_budget(space, spec)
    config = Config(num_stages, data_parallel, micro_batch_size,
                    batch_size // (data_parallel * micro_batch_size), space.schedules[0], virtual_stages=per_rank)
    measure = node_measure(model, graph, inputs, space, spec) if measures(model, spec, profile) else None
    search = Search(graph, spec, space, measure=measure)
    table, _ = search.costs(micro_batch_size)
    coarse = group_units(graph, table, space.precision, space.optimizer, _starts(graph, stage_starts))
    setup = search.setup(config, coarse)
    cuts = tuple(range(num_stages - 1))
    evaluation = evaluate(setup.costs, cuts)
    if offload is not None:
        if len(offload) != num_stages:
            raise InvalidArgument(f"offload lists {len(offload)} stage decisions but the split has "
                                  f"{num_stages} stages; give one OffloadSpec per stage")
        evaluation = dataclasses.replace(evaluation, forced=tuple(offload))
    candidate = Candidate(setup, evaluation, evaluation.step_ms, SolveStatus.OPTIMAL, "manual split", 0.0, "")
    result = SearchResult(candidate, None, 1, 1, 0.0)
    made = build_plan(graph, spec, space, result,
                      model_ref(graph, inputs, space, builder, builder_kwargs, leaf_modules))
    made = _tiled(made, spatial) if spatial else made
    warn_shared_cores(made)
    return made


def _parts_per_rank(kind: ScheduleKind, num_parts: int, virtual_stages: int | None) -> int:
    """The parts each pipeline rank of ``kind`` holds (its virtual stages), checked against ``num_parts``."""
    fixed = {ScheduleKind.INTERLEAVED_1F1B: None, ScheduleKind.WPIPE: 2}.get(kind, 1)
    if virtual_stages is not None and (isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int)
                                       or virtual_stages < 1):
        raise InvalidArgument(f"virtual_stages must be a whole number >= 1 (parts per rank), got {virtual_stages!r}")
    if fixed is not None and virtual_stages not in (None, fixed):
        raise InvalidArgument(f"virtual_stages={virtual_stages}: {kind.value} holds {fixed} part(s) per rank; "
                              f"give virtual_stages only with interleaved-1f1b")
    per_rank = virtual_stages or fixed or 2
    if kind is ScheduleKind.INTERLEAVED_1F1B and (per_rank < 2 or num_parts % per_rank or num_parts // per_rank < 2):
        raise InvalidArgument(f"{num_parts} parts cannot be held {per_rank} per rank by interleaved-1f1b: give "
                              f"virtual_stages >= 2 dividing the parts with 2+ ranks left, or stage_starts for more "
                              f"parts")
    if num_parts % per_rank:
        raise InvalidArgument(f"{kind.value} holds {per_rank} parts per rank, but stage_starts make {num_parts}: "
                              f"give stage_starts for a multiple of {per_rank} parts")
    return per_rank


def reschedule(plan: Plan, kind: str | ScheduleKind | Schedule, **options: Any) -> Plan:
    """``plan``'s parts under another schedule family, from its generator (planner/schedules/generate.py:
    e.g. ``virtual_stages=2`` for ``interleaved-1f1b``) or as a given Schedule (compute programs as
    data and their layout), lowered, validated and re-simulated on the plan's own stage costs; the
    runtime executes it like any plan.

    It takes a plan of one stage per part, without spatial tiles (the search chooses among the families itself;
    this runs a given plan's split under another). Example::

        p = reschedule(plan_with_split(model, example_inputs=x, stage_starts=starts, batch_size=8,
                                       micro_batch_size=2, schedule="gpipe"), "interleaved-1f1b",
                       virtual_stages=2)
    """
    tiled = [stage.index for stage in plan.stages if stage.spatial]
    if plan.layout.num_stages != plan.num_parts or tiled:
        raise InvalidArgument(f"reschedule takes a plan of one stage per part without spatial tiles; this one "
                              f"has {plan.layout.num_stages} stages for {plan.num_parts} parts and spatial "
                              f"stages {tiled}")
    if isinstance(kind, Schedule):
        return _relaid(plan, kind, plan.stages, f"the {kind.kind.value} programs given")
    try:
        schedule = generate(kind, plan.num_parts, plan.training.num_microbatches,
                            data_parallel=plan.data_parallel, **options)
    except (ValueError, TypeError) as error:
        raise InvalidArgument(f"{ScheduleKind.parse(kind).value}: {error}") from None
    return _relaid(plan, schedule, plan.stages, f"schedule {schedule.kind.value}")


def _tiled(plan: Plan, spatial: Mapping[int, SpatialSpec]) -> Plan:
    """The plan with ``spatial``'s stages on tiles: its layout and programs made again, re-simulated
    on the same (non-spatial) stage costs, and checked like a plan file."""
    stray = sorted(set(spatial) - set(range(plan.num_stages)))
    if stray:
        raise InvalidArgument(f"spatial names stages {stray} but the split has stages 0..{plan.num_stages - 1}")
    tiles = tuple(spatial[stage].parts if stage in spatial else 1 for stage in range(plan.num_stages))
    schedule = generate(plan.schedule.kind, plan.num_stages, plan.training.num_microbatches,
                        data_parallel=plan.data_parallel, tiles=tiles)
    stages = tuple(dataclasses.replace(stage, spatial=spatial.get(stage.index)) for stage in plan.stages)
    return _relaid(plan, schedule, stages, f"spatial {dict(spatial)}")


def _relaid(plan: Plan, schedule: Schedule, stages: tuple[StagePlan, ...], what: str) -> Plan:
    """``plan`` (one stage per part) with ``stages`` on ``schedule``'s layout: its transfers within each
    model copy, its programs lowered (swaps included) and validated, its predictions re-simulated on the
    same stage costs (its tied sums over the new layout's ranks), checked like a plan file (InvalidArgument naming
    ``what`` when it does not fit)."""
    layout = schedule.layout
    stages = _reduced_over(layout, plan, stages)
    transfers = tuple(dataclasses.replace(t, src_stage=layout.stage_of_copy(t.src_stage, copy),
                                          dst_stage=layout.stage_of_copy(t.dst_stage, copy))
                      for t in plan.transfers for copy in range(layout.num_copies))
    edges = {(t.src_stage, t.dst_stage) for t in transfers}
    swapping = {stage for stage in range(layout.num_stages) if stages[layout.part(stage)].offload.swap}
    programs = layout.rank_programs(lower(insert_swaps(schedule.programs, swapping), layout, edges))
    validate(programs, layout, edges=edges)
    device = DeviceSpec.from_dict(plan.cluster.device)
    tied = tuple(tied_sum_over(layout, t.parts, t.names, t.nbytes, device, plan.cluster.gpus_per_node, t.state_bytes)
                 for t in plan.tied_sums)
    costs = sim_costs(layout, stages, transfers, schedule.kind, plan.cluster.backend, tied)
    simulated = simulate(programs, layout, costs)
    batch = plan.training.global_batch_size
    # the search's why, runner-up and binding were of the plan before: what was done to it now says instead
    solver = dataclasses.replace(plan.solver, why=f"{what} set by hand (planner.manual) on the plan's split, its "
                                 f"step simulated on the same stage costs; not searched", binding="", runner_up=None)
    relaid = dataclasses.replace(
        plan, layout=layout, stages=stages, transfers=transfers, tied_sums=tied, programs=format_programs(programs),
        schedule=ScheduleSpec(schedule.kind, max_in_flight(schedule)),
        cluster=dataclasses.replace(plan.cluster, gpus=layout.world_size, gpus_available=layout.world_size),
        predicted=Prediction(simulated.step_ms, batch / simulated.step_ms * 1e3, simulated.bubble_fraction,
                             simulated.peak_mem_bytes), solver=solver)
    try:
        check_invariants(relaid)
    except PlanFileError as error:
        raise InvalidArgument(f"{what} does not fit the split: {error}") from None
    return relaid


def _reduced_over(layout: Layout, plan: Plan, stages: tuple[StagePlan, ...]) -> tuple[StagePlan, ...]:
    """``stages`` with each part's gradient all-reduce costed over its copies in ``layout`` where their
    number is not ``plan``'s (GEMS-MASTER's mirrored replica holds a second copy of every part), as the
    search costs it: a ring over the copies of the part's gradients but the tied weights' (kept as planned where
    they are sharded, ZeRO-2/3, and so not recorded)."""
    device = DeviceSpec.from_dict(plan.cluster.device)
    rings = part_allreduces(device, layout, plan.cluster.gpus_per_node)

    def reduced(stage: StagePlan) -> StagePlan:
        part, predicted = stage.index, stage.predicted
        if len(layout.part_ranks(part)) == len(plan.layout.part_ranks(part)) or not predicted.grad_bytes:
            return stage
        return dataclasses.replace(stage, predicted=dataclasses.replace(
            predicted, allreduce_ms=untied_allreduce_ms(part, rings[part].ms(predicted.grad_bytes), rings[part],
                                                        plan.tied_sums)))
    return tuple(reduced(stage) for stage in stages)


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
    staying = staying_values(graph)
    for start in starts:
        if staying[start - 1] is not None:
            value = staying[start - 1]
            raise InvalidArgument(f"stage_starts {graph.nodes[start].name!r} cuts while {value!r}'s value (not a "
                                  f"tensor: it cannot cross a stage boundary) is still read; start the stage at "
                                  f"{value!r} or after its last reader {graph.users[value][-1]!r}")
    return starts
