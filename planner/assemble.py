"""Assemble the Plan of a search result: lower the winning schedule, validate and simulate it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from cost_models.comm import GATHERS_AHEAD
from cost_models.devices import DeviceSpec
from cost_models.fused import FusedHalos
from cost_models.graph.ir import LayerGraph, NodeKind
from cost_models.memory import model_state_bytes
from cost_models.spatial import halo_bytes, stage_geometry, tile_geometry
from cost_models.units import format_ms, plural
from planner.gathers import group_cap_bytes, group_layers, layer_calls, regrouped
from planner.plan import (
    ClusterSpec,
    HaloMode,
    LayerRow,
    ModelRef,
    OffloadSpec,
    ParamTier,
    Plan,
    Prediction,
    RunnerUp,
    ScheduleSpec,
    SolverReport,
    SpatialSpec,
    StagePlan,
    StagePrediction,
    TiedSum,
    TrainingSpec,
    Transfer,
    freeze,
)
from planner.schedules.actions import Program, format_programs
from planner.schedules.lower import lower
from planner.schedules.simulate import SimResult, simulate
from planner.schedules.swaps import insert_swaps
from planner.schedules.validate import validate
from planner.search.configs import gpus_note
from planner.search.evaluate import PartSummary, evaluate, region_start
from planner.search.ilp import SolveStatus
from planner.search.problem import ON_GPU, tied_sums, untied_allreduce_ms, whole_pass_params
from planner.search.search import (
    FAMILY_SLACK,
    OFFLOAD_MUST_GAIN,
    TILES_MUST_GAIN,
    Candidate,
    SearchResult,
    SearchSpace,
)
from planner.search.terms import gathered_layer_copies, layer_collective_fixed_ms, layer_gather_ms_per_byte
from planner.search.working import PartWorking, part_working
from planner.simulation import sim_costs
from planner.stepped import stage_step_bytes


@dataclass(frozen=True)
class Lowered:
    """A candidate lowered to per-rank programs, validated, and replayed by the simulator."""

    parts: tuple[StagePlan, ...]
    transfers: tuple[Transfer, ...]
    tied_sums: tuple[TiedSum, ...]
    programs: tuple[Program, ...]
    simulated: SimResult


MEMORY_BINDS_AT = 0.9
"""A plan's memory is called binding when the search's bound on its fullest rank is at least this share of the
usable budget."""


def lower_candidate(candidate: Candidate, graph: LayerGraph, device: DeviceSpec, gpus_per_node: int) -> Lowered:
    """The candidate's per-rank programs (checked by the validator) and their simulated step."""
    setup = candidate.setup
    layout = setup.schedule.layout
    part_nodes = _part_nodes(candidate)
    transfers = _transfers(candidate, graph, part_nodes)
    tied = tied_sums(setup.problem.units, setup.problem.shared,
                     [range(part.first_unit, part.last_unit + 1) for part in candidate.evaluation.parts], layout,
                     device, gpus_per_node, [terms["state_bytes"].per_shared for terms in setup.costs.parts])
    edges = {(t.src_stage, t.dst_stage) for t in transfers}
    step_bytes = stage_step_bytes(graph, setup.problem, layout, part_nodes)
    parts = tuple(_stage_plan(candidate, index, nodes, graph, step_bytes[index], tied)
                  for index, nodes in enumerate(part_nodes))
    swapping = {stage for stage in range(layout.num_stages) if parts[layout.part(stage)].offload.swap}
    programs = layout.rank_programs(lower(insert_swaps(setup.schedule.programs, swapping), layout, edges))
    validate(programs, layout, edges=edges)
    simulated = simulate(programs, layout, sim_costs(layout, parts, transfers, setup.config.schedule,
                                                     setup.problem.backend, tied))
    return Lowered(parts, transfers, tied, programs, simulated)


def build_plan(graph: LayerGraph, device: DeviceSpec, space: SearchSpace, result: SearchResult,
               model: ModelRef) -> Plan:
    """Lower the winner's schedule to per-rank programs, validate and simulate them, and assemble the Plan.

    No plan leaves the planner that the validator rejects. Every step time the plan reports is
    the simulator's (the runner-up's too); the ILP objective stays in the solver report.
    """
    simulations = Simulations(graph, device, space.gpus_per_node)
    result = by_simulation(result, simulations)
    lowered = simulations.lowered(result.best)
    runner_up = None if result.runner_up is None else simulations.lowered(result.runner_up).simulated
    best = result.best
    setup = best.setup
    simulated = lowered.simulated
    return Plan(
        model=model,
        cluster=ClusterSpec(setup.config.gpus, space.gpus_per_node, freeze(device.to_dict()),
                            space.mem_bytes + space.reserve_bytes, space.reserve_bytes, space.gpus,
                            setup.problem.tiers.host_mem_bytes if space.offload else None,
                            setup.problem.tiers.nvme_bytes if space.offload else None),
        training=TrainingSpec(space.global_batch_size, setup.config.micro_batch_size,
                              setup.config.num_microbatches, space.optimizer),
        schedule=ScheduleSpec(setup.config.schedule, setup.problem.in_flight),
        layout=setup.schedule.layout,
        stages=lowered.parts,
        layers=tuple(LayerRow(c.name, c.fwd_ms, c.bwd_ms, c.param_bytes, c.saved_activation_bytes,
                              c.output_bytes) for c in setup.table.costs),
        programs=format_programs(lowered.programs),
        transfers=lowered.transfers,
        tied_sums=lowered.tied_sums,
        predicted=Prediction(simulated.step_ms, space.global_batch_size / simulated.step_ms * 1e3,
                             simulated.bubble_fraction, simulated.peak_mem_bytes),
        solver=_report(result, space, lowered, runner_up, simulations.step_ms),
    )


class Simulations:
    """Candidates lowered and simulated, each once (by identity: candidates are not hashable)."""

    def __init__(self, graph: LayerGraph, device: DeviceSpec, gpus_per_node: int) -> None:
        self.graph = graph
        self.device = device
        self.gpus_per_node = gpus_per_node
        self._lowered: dict[int, tuple[Candidate, Lowered]] = {}

    def lowered(self, candidate: Candidate) -> Lowered:
        if id(candidate) not in self._lowered:
            self._lowered[id(candidate)] = (candidate, lower_candidate(candidate, self.graph, self.device,
                                                                       self.gpus_per_node))
        return self._lowered[id(candidate)][1]

    def step_ms(self, candidate: Candidate) -> float:
        return self.lowered(candidate).simulated.step_ms


REFINE_TRIALS = 24
"""How many partitions next to a family's fastest finalist :func:`refined` simulates at most, per family
costed from its replayed programs: a partition of AmoebaNet-D, BERT-large or GPT-8.3B on 16 GPUs takes 20-270 ms
to lower and simulate, so up to about 6 s of planning a family (AmoebaNet-D's two refined families took 2 s)."""


REFINE_MUST_GAIN = 0.01
"""A partition whose cuts the simulator moved (:func:`refined`) replaces a solver's only when it simulates at least
this much faster: it is the best of many neighbours on the simulator's step, whose errors such a pick leans on (a
0.1% gain turned a ResNet-50 plan on 8 GPUs from GPipe to another family)."""


def by_simulation(result: SearchResult, simulations: Simulations) -> SearchResult:
    """``result`` with the finalist (planner/search/search.py: SearchResult.finalists) that simulates fastest
    (with its runner-up and its best plans keeping everything on the GPU and without tiles) as its winner:
    the search ranks by step models, of which only GPipe's and 1F1B's are exact, so the simulator decides
    between them, and it moves the cuts of each other family's fastest finalist within FAMILY_SLACK of the
    fastest (:func:`refined`); one that offloads or tiles where the search's winner does not must beat it by
    the search's margins for that. The runner-up is the best plan of another schedule family when there is
    one, else of another configuration."""
    finalists = [candidate for candidate in (result.runner_up, result.best_on_gpu, result.best_untiled,
                                             *result.finalists) if candidate is not None]
    step_ms = simulations.step_ms
    fastest_ms = min((step_ms(candidate) for candidate in finalists), default=0.0)  # (none: a split given)
    for kind in dict.fromkeys(c.setup.config.schedule for c in finalists if not c.setup.config.schedule.closed_form):
        own = min((c for c in finalists if c.setup.config.schedule is kind), key=step_ms)
        if step_ms(own) <= (1 + FAMILY_SLACK) * fastest_ms:
            finalists.append(refined(own, step_ms))
    best = result.best
    for candidate in sorted(finalists, key=step_ms):
        if step_ms(candidate) < (1 - _must_gain(candidate, best)) * step_ms(best) - 1e-9:
            best = candidate
    others = [c for c in finalists if c.setup.config.schedule is not best.setup.config.schedule]
    if not others:  # one family among the finalists: its best other configuration (not the winner's own
        others = [c for c in finalists if c.setup.config != best.setup.config]  # partition before refining)
    return dataclasses.replace(result, best=best, runner_up=min(others, key=step_ms, default=None))


def refined(candidate: Candidate, step_ms: Callable[[Candidate], float], trials: int = REFINE_TRIALS) -> Candidate:
    """``candidate`` with its cuts moved while its simulated step shrinks: each cut by 4, then 2, then 1 units
    either way, a move kept where the partition fits the memory rows the search holds it to and simulates
    faster, until no move of the smallest size helps or ``trials`` partitions were simulated. The families costed
    from their replayed programs (interleaved 1F1B, ZB-H1, GEMS-MASTER) have step models that miss their
    simulated steps by up to FAMILY_SLACK, so the partition their ILP finds best need not simulate best:
    AmoebaNet-D's ZB-H1 plan on 16 V100s (2 stages x 8 copies) went from 85.5 to 82.4 ms with its cut one
    cell later, faster than the interleaved plan picked before (85.4 ms). Itself where the family's step
    model is exact (GPipe, 1F1B), where it has memory decisions (chosen for its cuts) or spatial tiles."""
    costs = candidate.setup.costs
    if (candidate.setup.config.schedule.closed_form or candidate.evaluation.decisions is not None
            or candidate.setup.config.spatial or not candidate.evaluation.cuts):
        return candidate
    start_ms = step_ms(candidate)
    best, best_ms, tried = candidate, start_ms, 0
    for size in (4, 2, 1):
        moved = True
        while moved and tried < trials:
            moved = False
            for index in range(len(best.evaluation.cuts)):
                for delta in (-size, size):
                    cuts = list(best.evaluation.cuts)
                    cuts[index] += delta
                    inside = cuts == sorted(set(cuts)) and 0 <= cuts[0] <= cuts[-1] < costs.num_units - 1
                    if tried >= trials or not inside:
                        continue
                    evaluation = evaluate(costs, tuple(cuts))
                    if not (evaluation.fits(costs.problem.mem_bytes) and evaluation.capacity_fits):
                        continue
                    # (the solver's objective stays: it ranked the configuration)
                    trial = dataclasses.replace(best, evaluation=evaluation, refined_from_ms=start_ms)
                    tried += 1
                    if step_ms(trial) < best_ms * (1 - 1e-9):
                        best, best_ms, moved = trial, step_ms(trial), True
    return best


def _must_gain(candidate: Candidate, best: Candidate) -> float:
    """How much faster ``candidate`` must simulate to replace ``best``: the search's margin for offloading
    or for tiles where it uses them and ``best`` does not, and for cuts the simulator moved, else nothing."""
    def offloads(c: Candidate) -> bool:
        return c.setup.config.state != ON_GPU or c.evaluation.decisions is not None
    gain = OFFLOAD_MUST_GAIN if offloads(candidate) and not offloads(best) else 0.0
    if candidate.setup.config.spatial and not best.setup.config.spatial:
        gain = max(gain, TILES_MUST_GAIN)
    if candidate.refined_from_ms is not None and best.refined_from_ms is None:
        gain = max(gain, REFINE_MUST_GAIN)
    return gain


def _part_nodes(best: Candidate) -> list[tuple[str, ...]]:
    units = best.setup.coarsening.units
    return [tuple(name for unit in units[p.first_unit:p.last_unit + 1] for name in unit.nodes)
            for p in best.evaluation.parts]


def _transfers(best: Candidate, graph: LayerGraph, part_nodes: list[tuple[str, ...]]) -> tuple[Transfer, ...]:
    """Bytes each stage sends each later stage per micro-batch (skip connections included), per model copy."""
    part_of = {name: index for index, names in enumerate(part_nodes) for name in names}
    sent: dict[tuple[int, int], int] = {}
    grads: dict[tuple[int, int], int] = {}  # of those, the values whose gradient comes back
    messages: dict[tuple[int, int], int] = {}  # values crossing: a message (one tensor) each
    for node in graph:
        if node.kind is NodeKind.PARAM:
            continue
        nbytes = best.setup.table[node.name].output_bytes
        carries_grad = bool(node.outputs) and all(meta.requires_grad for meta in node.outputs)
        for target in {part_of[user] for user in graph.users[node.name]} - {part_of[node.name]}:
            edge = (part_of[node.name], target)
            sent[edge] = sent.get(edge, 0) + nbytes
            grads[edge] = grads.get(edge, 0) + (nbytes if carries_grad else 0)
            messages[edge] = messages.get(edge, 0) + 1
    layout, links = best.setup.schedule.layout, best.setup.problem.links
    return tuple(Transfer(src_stage, dst_stage, nbytes, links[src].ms(nbytes), grads[(src, dst)],
                          messages[(src, dst)] * links[src].post_ms_per_message)
                 for (src, dst), nbytes in sorted(sent.items())
                 for src_stage, dst_stage in zip(layout.stages_of_part(src), layout.stages_of_part(dst)))


def _stage_plan(best: Candidate, index: int, nodes: tuple[str, ...], graph: LayerGraph,
                step_bytes: float | None, tied: tuple[TiedSum, ...]) -> StagePlan:
    """Part ``index``'s plan; its optimizer step's buffers as the runtime packs them (``step_bytes``,
    planner/stepped.py), not the search's bound, where the problem costs a step; its all-reduce without the
    gradients of the weights it shares with other parts (``tied``: summed apart)."""
    part = best.evaluation.parts[index]
    if step_bytes is not None:
        part = dataclasses.replace(part, step_bytes=round(step_bytes))
    offload = _offload(best, index, graph)
    if offload.zero_stage == 3 and not offload.gathers and len(best.setup.schedule.layout.part_ranks(index)) > 1:
        part, offload = _gathered(best, index, nodes, graph, part, offload)
    tiers = best.setup.problem.tiers
    first_backward_bytes = 0
    if not (offload.recompute or offload.swap or offload.grads_on_host or offload.zero_stage == 3
            or index < len(best.setup.problem.spatial)
            or tiers.precision is None or tiers.optimizer is None):  # (node by node: gradients adding up on it;
        # ZeRO-3's leave each layer's backward reduced)
        working = part_working(graph, best.setup.table, nodes, tiers.precision, tiers.optimizer)
        part, first_backward_bytes = _node_by_node(part, working)
    return StagePlan(index, nodes, StagePrediction(
        part.fwd_ms, part.bwd_ms, sum(best.setup.table[name].param_bytes for name in nodes),
        part.held_bytes, part.activation_bytes,
        untied_allreduce_ms(index, part.allreduce_ms, best.setup.problem.allreduce[index], tied),
        part.optimizer_ms, part.swap_bytes, part.swap_ms, part.host_bytes, part.nvme_bytes,
        part.weight_grad_ms, part.grad_bytes if best.setup.config.state.zero_stage != 2 else 0,  # (ZeRO-3's: shards)
        part.step_excess_bytes, part.tied_excess_bytes, part.accumulate_excess_bytes, part.split_extra_ms,
        first_backward_bytes, part.split_kept_bytes,
        part.split_relief_bytes if best.setup.config.schedule.splits_backward and index > 0 else 0),
        spatial=_spatial(best, index, nodes, graph, offload), offload=offload)


def _gathered(best: Candidate, index: int, nodes: tuple[str, ...], graph: LayerGraph, part: PartSummary,
              offload: OffloadSpec) -> tuple[PartSummary, OffloadSpec]:
    """ZeRO-3 part ``index`` with its layers gathered in groups (planner/gathers.py) as large as the memory its
    ranks have left under the search's bound allows, shared among the parts each holds."""
    problem = best.setup.problem
    tiers, layout = problem.tiers, best.setup.schedule.layout
    if tiers.precision is None or tiers.optimizer is None:  # (a bare problem: no weights' bytes to group by)
        return part, offload
    copies = layout.part_ranks(index)
    room = min((problem.mem_bytes - best.evaluation.slot_peak_bytes[layout.place(rank).slot])
               / len(layout.parts_of_rank(rank)) for rank in copies)
    ahead = offload.prefetch or GATHERS_AHEAD[problem.backend]  # (a hand-made plan may ask for it)
    held = gathered_layer_copies(len(copies), problem.backend, ahead)
    searched = gathered_layer_copies(len(copies), problem.backend, GATHERS_AHEAD[problem.backend])  # (the search's)
    largest = max((unit.largest_layer_bytes for unit in problem.units), default=0)
    shared = {p.name for p in problem.shared}
    gathered = frozenset(p for name in nodes for p in graph.node(name).param_names
                         if graph.node(name).kind is NodeKind.MODULE and p not in shared
                         and not graph.parameter(p).is_buffer) - whole_pass_params(graph)
    weight_bytes = {p: model_state_bytes(graph.parameter(p).numel, tiers.precision, tiers.optimizer).param_bytes
                    for p in gathered}
    calls = layer_calls(graph, nodes, gathered, weight_bytes, offload)
    up = tiers.host_link if tiers.state.params_on_host else None
    gather_ms, reduce_ms = layer_collective_fixed_ms(problem.allreduce[index], up, problem.backend)
    gathers = group_layers(calls, group_cap_bytes(largest, (searched * largest + max(0.0, room)) / held, gather_ms,
                                                  layer_gather_ms_per_byte(problem.allreduce[index])))
    part = regrouped(part, calls, gathers, gather_ms=gather_ms, reduce_ms=reduce_ms, copies_held=(held, searched),
                     largest_layer_bytes=largest)
    return part, dataclasses.replace(offload, gathers=gathers.groups, prefetch=ahead)


def _node_by_node(part: PartSummary, working: PartWorking) -> tuple[PartSummary, int]:
    """``part`` with what it holds beside its activations counted node by node (planner/search/working.py)
    in place of the search's largest working set: its forwards' in the static bytes, its later backwards'
    in the accumulate event; and what the step's first backward adds above the static bytes (its gradients,
    made node by node, are in the static bytes only from its end)."""
    transient = working.transient_bytes
    kept = part.static_bytes - part.transient_bytes
    summary = dataclasses.replace(part, static_bytes=kept + transient, transient_bytes=transient,
                                  accumulate_bytes=working.accumulating_bytes,
                                  region_transient_bytes=min(part.region_transient_bytes, transient))
    return summary, max(0, working.first_backward_bytes - transient)


def _spatial(best: Candidate, index: int, nodes: tuple[str, ...], graph: LayerGraph,
             offload: OffloadSpec) -> SpatialSpec | None:
    """Part ``index``'s tiles (a leading part of a spatial configuration), with the halo bytes each tile
    sends per micro-batch (cost_models.spatial.halo_bytes: its recompute regions exchange again). The
    first part's grid cuts the input image; a later one's cuts each value it receives."""
    spatial = best.setup.problem.spatial
    if index >= len(spatial):
        return None
    choice = spatial[index].choice
    rows, cols = choice.grid_shape
    geometry = tile_geometry(graph, rows, cols) if index == 0 else stage_geometry(graph, rows, cols, nodes)
    members = set(nodes)
    groups = tuple(group for group in spatial[index].fused_groups if members.issuperset(group))
    fused = FusedHalos(graph, geometry)
    exchanges = tuple(fused.exchange(group, best.setup.table) for group in groups)
    halo = halo_bytes(geometry, best.setup.table, nodes, offload.recomputed_nodes, exchanges)
    return SpatialSpec(choice.parts, choice.slicing, HaloMode.FUSED if groups else HaloMode.PER_LAYER,
                       geometry.height, geometry.width, fused_groups=tuple(exchange.nodes for exchange in exchanges),
                       halo_bytes=halo)


def _offload(best: Candidate, index: int, graph: LayerGraph) -> OffloadSpec:
    """Part ``index``'s memory decisions as the runtime executes them: each run of recomputed units
    within a recompute block one checkpoint region (split where a parameter read or an input
    interrupts it: those are the stage's inputs, not computations), the nodes of each swapped unit,
    and the configuration's state mode."""
    evaluation = best.evaluation
    if evaluation.forced:
        return evaluation.forced[index]
    state = best.setup.config.state
    decisions, summary = evaluation.decisions, evaluation.parts[index]
    units = best.setup.coarsening.units
    regions: list[list[str]] = []
    swapped: list[str] = []
    for unit in range(summary.first_unit, summary.last_unit + 1) if decisions else ():
        if decisions.recompute[unit] > 0.5:
            if unit == summary.first_unit or region_start(decisions, unit, summary.first_unit) > 0.5:
                regions.append([])
            for name in units[unit].nodes:
                if graph.node(name).kind in (NodeKind.PARAM, NodeKind.INPUT, NodeKind.OUTPUT):
                    regions.append([])
                else:
                    regions[-1].append(name)
        elif decisions.swap[unit] > 0.5:
            swapped += [name for name in units[unit].nodes
                        if graph.node(name).kind not in (NodeKind.PARAM, NodeKind.INPUT, NodeKind.OUTPUT)]
    return OffloadSpec(tuple(tuple(region) for region in regions if region), tuple(swapped), state.zero_stage,
                       state.optimizer, ParamTier.HOST if state.params_on_host else ParamTier.GPU,
                       grads_on_host=state.grads_on_host)


def _report(result: SearchResult, space: SearchSpace, lowered: Lowered,
            runner_up_simulated: SimResult | None, simulated_ms: Callable[[Candidate], float]) -> SolverReport:
    best, runner_up, simulated = result.best, result.runner_up, lowered.simulated
    if best.solver == "manual split":
        return SolverReport(best.solver, best.status.value, best.objective_ms, 0.0, result.wall_s, 1,
                            f"split given by the user: {best.setup.config.describe()}; not searched", "")
    why = f"{best.setup.config.describe()} has the lowest step ({format_ms(simulated.step_ms)})"
    if runner_up is not None and runner_up.objective_ms < best.objective_ms and runner_up_simulated is not None \
            and runner_up_simulated.step_ms > simulated.step_ms:
        why = (f"{best.setup.config.describe()} has the lowest simulated step ({format_ms(simulated.step_ms)}; "
               f"the step models of the schedule families ranked the runner-up first)")
    elif runner_up is not None and runner_up.objective_ms < best.objective_ms:
        why = (f"{best.setup.config.describe()} ({format_ms(simulated.step_ms)}) keeps everything on the GPU "
               f"within {OFFLOAD_MUST_GAIN:.0%} of the fastest plan")
    runner = None
    if runner_up is not None and runner_up_simulated is not None:
        config, step_ms = runner_up.setup.config, runner_up_simulated.step_ms
        why += f"; runner-up {config.describe()} at {format_ms(step_ms)} ({step_ms / simulated.step_ms:.2f}x)"
        runner = RunnerUp(config.num_stages, config.data_parallel, config.micro_batch_size, config.schedule,
                          step_ms)
    why += (f"; {result.configs_solved} of {plural(result.configs_total, 'configuration')} solved, the rest "
            f"could not fit the memory or could not beat it, nor the plans simulated beside it (lower bound)")
    note = gpus_note(space, best.setup.config.gpus)
    offload, tiles = result.offload_note(simulated_ms), result.tiles_note(simulated_ms)
    why += (f"; {note}" if note else "") + (f"; {offload}" if offload else "") + (f"; {tiles}" if tiles else "")
    if best.refined_from_ms is not None:
        why += (f"; its cuts moved by the simulator from the solver's partition "
                f"({format_ms(best.refined_from_ms)} -> {format_ms(simulated.step_ms)})")
    why += _unproven(best, result, space)
    gap = None if math.isnan(best.gap) else best.gap  # unknown: the solve stopped before proving a bound
    return SolverReport(best.solver, best.status.value, best.objective_ms, gap, result.wall_s,
                        result.configs_total, why, _binding(best, space, lowered), runner,
                        result.configs_unexamined, best.local)


def _binding(best: Candidate, space: SearchSpace, lowered: Lowered) -> str:
    """The slowest stage, and the fullest rank when the search's bound on its memory (every saved activation
    beside the largest working set: planner/search/terms.py, with the ZeRO-3 gather groups' memory,
    :func:`_gathered`) is near the usable budget, with its predicted peak (node by node,
    planner/search/working.py: at most the bound)."""
    parts, simulated = best.evaluation.parts, lowered.simulated
    compute_ms = [stage.predicted.fwd_ms + stage.predicted.bwd_ms for stage in lowered.parts]
    slowest = max(range(len(parts)), key=lambda part: compute_ms[part])
    binding = f"compute of stage {slowest} ({format_ms(compute_ms[slowest])} per micro-batch)"
    layout = best.setup.schedule.layout
    grouped = [stage.predicted.static_bytes - part.held_bytes if stage.offload.gathers else 0
               for stage, part in zip(lowered.parts, parts)]  # (what its gather groups add)
    bounds = [best.evaluation.slot_peak_bytes[layout.place(rank).slot]
              + sum(grouped[part] for part in layout.parts_of_rank(rank)) for rank in range(layout.world_size)]
    fullest = max(range(len(bounds)), key=lambda rank: (bounds[rank], simulated.peak_mem_bytes[rank]))
    share = bounds[fullest] / space.mem_bytes
    if share >= MEMORY_BINDS_AT:
        peak_ms = max(simulated.memory_timeline[fullest], key=lambda point: point[1])[0]
        at_step = any(event.rank == fullest and event.action.endswith("OPTIMIZER_STEP") and event.start_ms == peak_ms
                      for event in simulated.events)  # the step's buffers on top of the model state
        peak = simulated.peak_mem_bytes[fullest] / space.mem_bytes
        binding += (f"; memory of rank {fullest} ({share:.0%} of the usable budget as the search bounds it, "
                    f"{peak:.0%} at its predicted peak" + (", at its optimizer step)" if at_step else ")"))
    return binding


def _unproven(best: Candidate, result: SearchResult, space: SearchSpace) -> str:
    """Why the plan is not proven the best, if it is not ("" when it is)."""
    reasons = []
    if best.status is SolveStatus.FEASIBLE and best.seed:
        reasons.append("the plan is its configuration's least-memory split, which no ILP improved or proved "
                       "best in time")
    elif best.status is SolveStatus.FEASIBLE:
        reasons.append(f"the solver stopped at the time limit ({space.time_limit_s:g} s) on the winning "
                       f"configuration")
    if result.configs_unexamined:
        reasons.append(f"the time limit ({space.time_limit_s:g} s) ended the search with "
                       f"{plural(result.configs_unexamined, 'configuration')} that might have won "
                       f"unexamined")
    fix = "; raise --time-limit" if reasons else ""
    if best.local:
        reasons.append(_LOCAL_DECISIONS if best.evaluation.decisions is not None else _LOCAL_CUTS)
    return f"; NOT PROVEN OPTIMAL: {' and '.join(reasons)}{fix}" if reasons else ""


_LOCAL_DECISIONS = ("its recompute and swap were chosen with each cut within a window of units around the best "
                    "plan keeping every activation (planner/search/search.py: Search._decide)")
_LOCAL_CUTS = ("its ranks hold several parts each, whose cuts were chosen within a window of units around even cuts "
               "(planner/search/search.py: _shared_slot_window)")
