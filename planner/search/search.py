"""The outer search: enumerate (stages, data parallel, micro-batch, schedule), solve each ILP.

Configurations (planner/search/configs.py) are visited in order of a lower bound on their step
time and skipped once the bound cannot beat the best plan found, so most of the ILPs of a large
search are never built. Progress goes to an optional callback; Ctrl-C stops the search anywhere,
the solver included (planner/search/ilp.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import isqrt
from typing import Any

from cost_models.comm import p2p_link, ring_allreduce_coefficients
from cost_models.devices import DeviceSpec
from cost_models.errors import PlanInfeasible, SpatialError
from cost_models.estimation import CostTable, estimate
from cost_models.fused import FusedGroup, FusedHalos
from cost_models.graph.ir import LayerGraph
from cost_models.spatial import TileCost, TileGeometry, image_input, tile_costs, tile_geometry
from cost_models.units import format_bytes
from planner.plan.kinds import ScheduleKind
from planner.plan.parts import StateTier
from planner.plan.spatial import Slicing
from planner.progress import Phase, Progress, ProgressEvent
from planner.schedules.balanced import BalancedStep, family_step
from planner.schedules.generate import (
    Schedule,
    accumulating_in_flight,
    generate,
    max_in_flight,
    swapped_resident,
    weight_grads_waiting,
)
from planner.search.configs import Config, SearchSpace, configurations, gpu_counts
from planner.search.evaluate import Decisions, Evaluation, evaluate
from planner.search.ilp import SolveStatus, Window, solve_partition
from planner.search.infeasible import capacity_error, infeasible_error
from planner.search.oracle import (
    OracleResult,
    check_exact,
    decided_step_floor,
    min_peak_partition,
    shared_slot_step_floor,
    window_memory_floor,
)
from planner.search.problem import (
    ON_GPU,
    Coarsening,
    Offload,
    PipelineProblem,
    SpatialChoice,
    SpatialPart,
    coarsen,
    crossing_bytes,
    describe_tiles,
    group_units,
    memory_tiers,
    part_allreduces,
    part_links,
    spatial_part,
)
from planner.search.terms import CostModel, cost_model, lower_bound

TiledCosts = tuple[dict[str, TileCost], tuple[FusedGroup, ...], dict[str, float]]


@dataclass(frozen=True)
class Setup:
    """One configuration ready to solve: its schedule (programs and layout), problem and costs."""

    config: Config
    schedule: Schedule
    problem: PipelineProblem
    costs: CostModel  # the problem's cost terms, every saved activation kept
    coarsening: Coarsening
    table: CostTable
    decided_problem: PipelineProblem | None = None  # the problem with recompute and swap (offload on)

    @functools.cached_property
    def decided(self) -> CostModel | None:
        """The costs with recompute and swap decided per unit (built when first needed)."""
        return None if self.decided_problem is None else cost_model(self.decided_problem)

    @property
    def frugal_costs(self) -> CostModel:
        """The cost model that can need the least memory."""
        return self.decided or self.costs


@dataclass(frozen=True)
class Candidate:
    """A configuration's best partition (``evaluation.cuts``) and how the solver found it."""

    setup: Setup
    evaluation: Evaluation
    objective_ms: float
    status: SolveStatus
    solver: str
    gap: float
    binding: str
    local: bool = False  # memory decisions optimised with each cut in a window, not over every partition
    seed: bool = False  # the search's first plan (Search.seed), not from an ILP
    refined_from_ms: float | None = None  # the simulated step of the solver's partition, where the simulator
    # moved its cuts (planner/assemble.py: refined)


@dataclass(frozen=True)
class SearchResult:
    best: Candidate
    runner_up: Candidate | None
    configs_total: int
    configs_solved: int
    wall_s: float
    solver_s: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    configs_unexamined: int = 0  # could still have won when the time limit ended the search
    best_on_gpu: Candidate | None = None  # the best plan found keeping every activation and all state on the GPU
    on_gpu_fits: bool | None = False  # some configuration keeping everything on the GPU fits (None: not known)
    best_untiled: Candidate | None = None  # the best plan found without image tiles
    spatial_note: str = ""  # why no plan tiles the image, when the search could not consider any
    finalists: tuple[Candidate, ...] = ()  # what the simulator chooses among (planner/assemble.py: by_simulation)

    def offload_note(self, step_ms: Callable[[Candidate], float] = lambda c: c.objective_ms) -> str:
        """Which memory decision bought the winner its fit or its speed ("" when it made none), plans
        compared by ``step_ms`` (default their objective; the plan's report passes their simulated step)."""
        best = self.best
        decisions = best.evaluation.decisions
        said = [text for text in (best.setup.config.state.describe(), _activations(decisions)) if text]
        if not said:
            return ""
        if self.best_on_gpu is None and self.on_gpu_fits is False:
            return f"{' and '.join(said)} bought the fit: no plan keeping everything on the GPU fits"
        if self.best_on_gpu is None and self.configs_unexamined:  # the time limit ended the search
            return f"{' and '.join(said)} bought the fit or the speed: no plan keeping everything on the GPU was " \
                   f"found in the time limit"
        if self.best_on_gpu is None:
            could = "" if self.on_gpu_fits else " fits, or"
            return (f"{' and '.join(said)} bought the {'speed' if self.on_gpu_fits else 'fit or the speed'}: "
                    f"no plan keeping everything on the GPU{could} could come within {OFFLOAD_MUST_GAIN:.0%} "
                    f"of it (its configuration's lower bound)")
        other = self.best_on_gpu
        return (f"{' and '.join(said)} bought the speed: {step_ms(other) / step_ms(best):.2f}x the "
                f"best plan keeping everything on the GPU ({other.setup.config.describe()})")

    def tiles_note(self, step_ms: Callable[[Candidate], float] = lambda c: c.objective_ms) -> str:
        """What tiling the image bought the winner, or why no plan tiles it ("" when neither applies), plans
        compared by ``step_ms`` (as for :meth:`offload_note`)."""
        spatial = self.best.setup.config.spatial
        if not spatial:
            return self.spatial_note
        stop = self.best.setup.problem.spatial[-1].stop
        reach = f" (a spatial stage ends by the first layer that cannot be tiled: {stop})" if stop else ""
        tiles = describe_tiles(spatial)
        if self.best_untiled is None and self.configs_unexamined:  # the time limit ended the search
            return f"{tiles} bought the fit or the speed: no plan without tiles was found in the time limit{reach}"
        if self.best_untiled is None:
            return (f"{tiles} bought the fit or the speed: no plan without tiles fits, or could beat "
                    f"it (its configuration's lower bound){reach}")
        other = self.best_untiled
        return (f"{tiles} bought the speed: {step_ms(other) / step_ms(self.best):.2f}x the "
                f"best plan without tiles ({other.setup.config.describe()}){reach}")


class Search:
    """Costs per micro-batch size, and each configuration's setup, are computed once and shared."""

    def __init__(self, graph: LayerGraph, device: DeviceSpec, space: SearchSpace,
                 progress: Progress | None = None, measure: Callable[[int], CostTable] | None = None) -> None:
        self.graph = graph
        self.device = device
        self.space = space
        self.progress = progress
        self.measure = measure  # the costs at a micro-batch size, measured (default: estimated by roofline)
        self._tables: dict[int, tuple[CostTable, Coarsening]] = {}
        self._setups: dict[Config, Setup] = {}
        self._min_peaks: dict[tuple[Config, bool], OracleResult | None] = {}
        self._schedules: dict[tuple, Schedule] = {}
        self._balanced: dict[tuple, BalancedStep] = {}
        self._geometries: dict[SpatialChoice, TileGeometry] = {}
        self._fused: dict[SpatialChoice, FusedHalos] = {}  # each geometry's fused-halo costing (memoised walks)
        self._bounds: dict[Config, float] = {}
        self._decided_bounds: dict[Config, float] = {}
        self._tiles: dict[tuple[int, SpatialChoice], TiledCosts] = {}
        self._merged: dict[tuple[int, tuple[SpatialChoice, ...]], Coarsening] = {}  # units of spatial configs
        self._spatial: dict[tuple[int, SpatialChoice, tuple[SpatialChoice, ...]], SpatialPart] = {}
        self.spatial_note = ""  # why no plan may tile the image (set by tilings())

    def costs(self, micro_batch_size: int) -> tuple[CostTable, Coarsening]:
        if micro_batch_size not in self._tables:
            self._report(ProgressEvent(Phase.COSTING, detail=f"micro-batch size {micro_batch_size}"))
            table = self.measure(micro_batch_size) if self.measure else estimate(
                self.graph, self.device, self.space.optimizer, self.space.precision, batch_size=micro_batch_size)
            self._tables[micro_batch_size] = (table, coarsen(
                self.graph, table, self.space.precision, self.space.optimizer, self.space.max_units))
        return self._tables[micro_batch_size]

    def setup(self, config: Config, coarse: Coarsening | None = None) -> Setup:
        """``config``'s schedule and problem over ``coarse`` (default: the search's units, cached)."""
        if coarse is None and config in self._setups:
            return self._setups[config]
        table, default = self.costs(config.micro_batch_size)
        spatial_units = config.spatial and self._spatial_units(config.micro_batch_size, config.spatial)
        units = coarse or spatial_units or default
        schedule = self.schedule(config)
        # per stage, what its programs hold (counted once per schedule: Schedule.held)
        in_flight, resident = max_in_flight(schedule), swapped_resident(schedule)
        accumulating, (waiting, waiting_at_transient) = accumulating_in_flight(schedule), weight_grads_waiting(schedule)
        layout, per_node = schedule.layout, self.space.gpus_per_node
        problem = PipelineProblem(
            units.units, units.boundary_bytes, units.shared, layout, config.schedule, config.num_microbatches,
            in_flight, part_links(self.device, layout, per_node),
            part_allreduces(self.device, layout, per_node), self.space.mem_bytes,
            memory_tiers(self.device, self.space, config.state, activations=False),
            tuple(self._spatial_part(choice, config.micro_batch_size, units, None if coarse else config.spatial)
                  for choice in config.spatial), self.balanced(config, units), resident,
            self.device.backend, accumulating, waiting, waiting_at_transient)
        decided = None
        if {Offload.RECOMPUTE, Offload.SWAP} & self.space.offload:
            tiers = memory_tiers(self.device, self.space, config.state, activations=True)
            if config.schedule.stale_weights:  # WPipe carries micro-batches across steps: it does not swap yet
                tiers = dataclasses.replace(tiers, swap=False)
            if config.schedule.splits_backward:  # a region would be recomputed in I and again per W group
                tiers = dataclasses.replace(tiers, recompute=False)  # (runtime/split_backward.py)
            if tiers.recompute or tiers.swap:
                decided = dataclasses.replace(problem, tiers=tiers)
        setup = Setup(config, schedule, problem, cost_model(problem), units, table, decided)
        if coarse is None:
            self._setups[config] = setup
        return setup

    def schedule(self, config: Config) -> Schedule:
        """``config``'s generated programs and layout (cached: alike for every state mode)."""
        key = _schedule_key(config)
        if key not in self._schedules:
            schedule = generate(config.schedule, config.num_stages, config.num_microbatches,
                                data_parallel=config.data_parallel, **_shape(config))
            self._schedules[key] = schedule
        return self._schedules[key]

    def balanced(self, config: Config, units: Coarsening) -> BalancedStep | None:
        """A family without a closed form: its programs (one replica) replayed with every part costing the
        model's average part over ``units``, normalised to a part-time of 1 (the objective needs the
        shape only; cached by the shares of forward and weight gradient, to the percent)."""
        if config.schedule.closed_form:
            return None
        forward = sum(unit.fwd_ms for unit in units.units)
        total = forward + sum(unit.bwd_ms for unit in units.units)
        weight_grad = sum(unit.weight_grad_ms for unit in units.units)
        shares = (round(forward / total, 2), round(weight_grad / total, 2)) if total > 0 else (0.5, 0.0)
        key = (config.schedule, config.num_stages, config.num_microbatches, config.virtual_stages, shares)
        if key not in self._balanced:
            self._balanced[key] = family_step(config.schedule, config.num_stages, config.num_microbatches,
                                              shares[0], 1.0 - shares[0], shares[1], **_shape(config))
        return self._balanced[key]

    def distinct(self, configs: Sequence[Config]) -> list[Config]:
        """``configs`` less those whose schedule runs the very programs of an earlier one's on the same
        layout (one micro-batch: GPipe and 1F1B are the same plan), the first kept."""
        seen: set[tuple] = set()
        kept = []
        # Alike programs and layout get one number, so that programs are hashed once per schedule, not
        # once per configuration.
        numbers: dict[tuple, int] = {}  # (programs, layout) -> number
        runs: dict[tuple, int] = {}  # schedule key -> the number of its programs and layout
        for config in configs:
            run = _schedule_key(config)
            if run not in runs:
                schedule = self.schedule(config)
                runs[run] = numbers.setdefault((schedule.programs, schedule.layout), len(numbers))
            key = (dataclasses.replace(config, schedule=ScheduleKind.GPIPE), runs[run])
            if key not in seen:
                seen.add(key)
                kept.append(config)
        return kept

    def tilings(self) -> tuple[SpatialChoice, ...]:
        """The tile grids stage 0 may use: P (2 <= P < a GPU count) a power of two or dividing the count,
        square where P is a square, vertical strips, and horizontal ones for a non-square image, each
        where the model's image input and first layers can be cut so (SpatialError else: ``spatial_note``
        says why when none can)."""
        if not self.space.spatial:
            return ()
        try:
            _, _, height, width = image_input(self.graph).output_shape  # type: ignore[misc]
        except SpatialError:
            return ()  # not an image model: nothing to say
        counts = sorted({parts for gpus in gpu_counts(self.space) for parts in range(2, gpus)
                         if gpus % parts == 0 or parts & (parts - 1) == 0})
        if not counts:
            self.spatial_note = ("no plan tiles the image: tiles need 3+ GPUs (stage 0 on 2+ tiles "
                                 "and an ordinary stage after it)")
            return ()
        choices = []
        errors = []
        for parts in counts:
            slicings = ([Slicing.SQUARE] if isqrt(parts) ** 2 == parts else []) + [Slicing.VERTICAL] + (
                [Slicing.HORIZONTAL] if height != width else [])
            for slicing in slicings:
                choice = SpatialChoice(parts, slicing)
                try:
                    self._geometry(choice)
                except SpatialError as error:
                    errors.append(str(error))
                    continue
                choices.append(choice)
        if not choices and errors:
            self.spatial_note = f"no plan tiles the image: {errors[0]}"
        return tuple(choices)

    def _geometry(self, choice: SpatialChoice) -> TileGeometry:
        if choice not in self._geometries:
            self._geometries[choice] = tile_geometry(self.graph, *choice.grid_shape)
            self._fused[choice] = FusedHalos(self.graph, self._geometries[choice])
        return self._geometries[choice]

    def _tile_costs(self, choice: SpatialChoice, micro_batch_size: int) -> TiledCosts:
        """Per tiled node its cost on ``choice``'s slowest tile, the fused halo groups that make the
        tiled run fastest (chosen over the search's units), and per node what crosses the cut after it
        on the largest tile (cached)."""
        key = (micro_batch_size, choice)
        if key not in self._tiles:
            table, units = self.costs(micro_batch_size)
            link = p2p_link(self.device, same_node=True)  # a replica's tiles are consecutive ranks of one node
            allreduce = ring_allreduce_coefficients(choice.parts, link)
            geometry = self._geometry(choice)
            tiles = tile_costs(geometry, table, link, allreduce)
            fused = self._fused[choice].choose([unit.nodes for unit in units.units], table, link, allreduce, tiles)
            tiles.update((name, cost) for group in fused for name, cost in group.costs.items())
            grids = geometry.grids
            crossing = crossing_bytes(self.graph, lambda name: table[name].output_bytes * (
                grids[name].largest_share if name in grids else 1.0))
            self._tiles[key] = (tiles, fused, {node.name: nbytes for node, nbytes in zip(self.graph, crossing)})
        return self._tiles[key]

    def _spatial_units(self, micro_batch_size: int, choices: tuple[SpatialChoice, ...]) -> Coarsening:
        """The search's units with the units of each fused group of ``choices`` merged into one, so a
        memory decision (made per unit) recomputes or swaps a fused group whole or not at all."""
        key = (micro_batch_size, choices)
        if key not in self._merged:
            table, units = self.costs(micro_batch_size)
            starts = list(itertools.accumulate((len(unit.nodes) for unit in units.units), initial=0))
            unit_of = {name: index for index, unit in enumerate(units.units) for name in unit.nodes}
            inside = {unit for choice in choices for group in self._tile_costs(choice, micro_batch_size)[1]
                      for unit in range(unit_of[group.nodes[0]] + 1, unit_of[group.nodes[-1]] + 1)}
            self._merged[key] = units if not inside else group_units(
                self.graph, table, self.space.precision, self.space.optimizer,
                [starts[unit] for unit in range(1, len(units.units)) if unit not in inside])
        return self._merged[key]

    def _spatial_part(self, choice: SpatialChoice, micro_batch_size: int, units: Coarsening,
                      choices: tuple[SpatialChoice, ...] | None) -> SpatialPart:
        """A part on ``choice``'s tiles over ``units``: cached when they are the units of a configuration
        tiled as ``choices`` (Search._spatial_units), not when a caller gives its own (None)."""
        key = (micro_batch_size, choice, choices)
        if choices is not None and key in self._spatial:
            return self._spatial[key]
        tiles, fused, crossing = self._tile_costs(choice, micro_batch_size)
        part = spatial_part(choice, units, self._geometry(choice), tiles, tuple(group.nodes for group in fused),
                            crossing)
        if choices is not None:
            self._spatial[key] = part
        return part

    def run(self) -> SearchResult:
        start = time.perf_counter()
        max_stages = len(self.costs(1)[1].units)
        configs = self.distinct(configurations(self.space, max_stages, self.tilings()))
        ranked = self.ranked(configs, start + self.space.time_limit_s)
        seed = self.seed(ranked)
        solved: list[Candidate] = [seed] if seed is not None else []
        pending: list[tuple[int, Config, Candidate | None]] = []  # configurations to decide memory for
        solver_s, unexamined = 0.0, 0
        # First every configuration keeping each activation (exact and fast), then recompute and swap
        # where that plan is missing or binds, each cut off by the best plan of either pass.
        for index, config in enumerate(ranked):
            best = _cutoff(config, min((c.objective_ms for c in solved), default=None))
            if best is not None and config.state == ON_GPU:  # preferred within OFFLOAD_MUST_GAIN: solve it there
                best *= 1 + OFFLOAD_MUST_GAIN
            own_seed = seed if seed is not None and seed.setup.config == config else None
            if best is not None and self.lower_bound(config) >= best:
                if own_seed is not None and self.lower_bound(config) >= own_seed.objective_ms:
                    solved[solved.index(own_seed)] = dataclasses.replace(  # its bound proves the seed optimal
                        own_seed, status=SolveStatus.OPTIMAL, gap=0.0)
                continue
            remaining = self.space.time_limit_s - (time.perf_counter() - start)
            if remaining <= 0 and solved:
                unexamined = sum(1 for c in ranked[index:] if self._known_bound(c) < _cutoff(c, best))
                break
            if not self._kept_fits(config):  # only memory decisions could fit it: whether they may is
                if self.setup(config).decided_problem is not None:  # checked when (if) its turn comes
                    pending.append((index, config, own_seed))
                continue
            if self._cannot_be_finalist(config, solved, kept=True):
                continue
            self._report(ProgressEvent(Phase.SEARCHING, index, len(ranked), best,
                                       f"solving {config.describe()}"))
            kept, decide, wall_s = self.solve_kept(config, max(1.0, remaining), best, own_seed)
            solver_s += wall_s
            if own_seed is not None:
                solved.remove(own_seed)  # kept is the ILP's better plan, or the seed itself
            if kept is not None:
                solved.append(kept)
            if decide:
                pending.append((index, config, kept))
        for position, (index, config, kept) in enumerate(pending):
            best = _cutoff(config, min((c.objective_ms for c in solved), default=None))
            if not self._fits_at_its_floor(config):  # a millisecond, where the bound below takes tens
                continue
            if best is not None and self.decided_bound(config, best) >= best:
                continue
            remaining = self.space.time_limit_s - (time.perf_counter() - start)
            if remaining <= 0 and solved:
                unexamined += sum(1 for _, c, _ in pending[position:] if self._known_bound(c) < _cutoff(c, best))
                break
            if not self.fits(config) or self._cannot_be_finalist(config, solved, kept=False):
                continue
            self._report(ProgressEvent(Phase.SEARCHING, index, len(ranked), best,
                                       f"deciding memory of {config.describe()}"))
            decided, wall_s = self.solve_decided(config, kept, min(max(1.0, remaining), DECISION_S), best)
            solver_s += wall_s
            if decided is not None:
                if kept is not None and kept.seed and kept in solved:
                    solved.remove(kept)  # the ILP's plan of the seed's configuration beats it
                solved.append(decided)
        self._report(ProgressEvent(Phase.SEARCHING, len(ranked), len(ranked),
                                   min((c.objective_ms for c in solved), default=None), "done"))
        if not solved:
            raise self.infeasible(configs)
        solved.sort(key=lambda c: (round(c.objective_ms, 9), c.setup.config.gpus,  # a tie: fewer GPUs
                                   c.evaluation.peak_mem_bytes))
        on_gpu = min((c for c in solved if c.setup.config.state == ON_GPU and c.evaluation.decisions is None),
                     key=lambda c: c.objective_ms, default=None)  # the best plan keeping everything on the GPU
        if on_gpu is not None and on_gpu.objective_ms <= (1 + OFFLOAD_MUST_GAIN) * solved[0].objective_ms:
            solved.remove(on_gpu)  # within the margin, a plan that offloads nothing is preferred
            solved.insert(0, on_gpu)
        untiled = min((c for c in solved if not c.setup.config.spatial), key=lambda c: c.objective_ms,
                      default=None)
        if untiled is not None and untiled.objective_ms <= (1 + TILES_MUST_GAIN) * solved[0].objective_ms:
            solved.remove(untiled)  # within the margin, a plan without tiles is preferred
            solved.insert(0, untiled)
        family_best = [min(family, key=lambda c: c.objective_ms) for kind in self.space.schedules
                       for family in [[c for c in solved if c.setup.config.schedule is kind]] if family]
        finalists = tuple({id(c): c for c in _close(solved) + family_best}.values())
        fits_on_gpu = {True} if on_gpu is not None else {self._kept_fit(c) for c in ranked if c.state == ON_GPU}
        on_gpu_fits = True if True in fits_on_gpu else None if None in fits_on_gpu else False
        return SearchResult(solved[0], solved[1] if len(solved) > 1 else None, len(configs),
                            len(solved), time.perf_counter() - start, solver_s,
                            configs_unexamined=unexamined, best_on_gpu=on_gpu, on_gpu_fits=on_gpu_fits,
                            best_untiled=untiled,
                            spatial_note=self.spatial_note, finalists=finalists)

    def _cannot_be_finalist(self, config: Config, solved: Sequence[Candidate], kept: bool) -> bool:
        """Whether no plan of ``config`` with recompute and swap decided (and, if ``kept``, none keeping every
        activation either) could be among what the search returns, the plans the simulator then chooses among: the
        FINALISTS fastest within FAMILY_SLACK (:func:`_close`), the fastest of each family, the runner-up, the
        fastest keeping everything on the GPU and the fastest without tiles (run). Its floor is at or above
        each of those so far, and they only fall as the search goes on. A family costed from its programs is
        solved up to FAMILY_SLACK above the best plan (_cutoff), so without this BERT-large on 16 V100s solved
        49 configurations, most of them slower than a dozen plans it had; 28 with it, returning the same plans."""
        close = _close(sorted(solved, key=lambda c: c.objective_ms))
        family = [c.objective_ms for c in solved if c.setup.config.schedule is config.schedule]
        if len(close) < FINALISTS or not family:
            return False
        marks = [close[-1].objective_ms, min(family)]
        if config.state == ON_GPU:
            marks.append(min((c.objective_ms for c in solved if c.setup.config.state == ON_GPU
                              and c.evaluation.decisions is None), default=float("inf")))
        if not config.spatial:
            marks.append(min((c.objective_ms for c in solved if not c.setup.config.spatial), default=float("inf")))
        need = max(marks) * (1 + 1e-9)
        if need == float("inf"):
            return False
        if self.lower_bound(config) >= need:  # (below every plan, with decisions or without)
            return True
        setup = self.setup(config)
        floors = ([setup.decided] if setup.decided is not None else []) + ([setup.costs] if kept else [])
        # with recompute and swap, and keeping every activation: the floors over the partitions that fit (not
        # decided_bound, whose cached bounds may stop at what it is asked for: here below the search's best)
        try:
            return all(decided_step_floor(costs, need) >= need for costs in floors)
        except ValueError:  # several stages share a slot: the lower bound alone
            return False

    def _report(self, event: ProgressEvent) -> None:
        if self.progress is not None:
            self.progress(event)

    def _min_peak(self, config: Config, frugal: bool) -> OracleResult | None:
        """The partition of ``config`` needing the least memory, keeping every activation or with every
        decision at its most frugal (None where the DP does not apply: several stages share a slot)."""
        key = (config, frugal)
        if key not in self._min_peaks:
            costs = self.setup(config).frugal_costs if frugal else self.setup(config).costs
            try:
                check_exact(costs, decisions_allowed=frugal)
            except ValueError:
                self._min_peaks[key] = None
            else:
                self._min_peaks[key] = min_peak_partition(costs)
        return self._min_peaks[key]

    def _kept_fits(self, config: Config) -> bool:
        """Whether some partition keeping every activation may fit (exact by DP where it applies)."""
        return self._kept_fit(config) is not False

    def _kept_fit(self, config: Config) -> bool | None:
        """Whether some partition keeping every activation fits: None where no DP applies and the
        memory floor does not rule it out."""
        if self.setup(config).costs.floor_bytes > self.space.mem_bytes:
            return False
        lowest = self._min_peak(config, frugal=False)
        return None if lowest is None else lowest.peak_bytes <= self.space.mem_bytes

    def _fits_at_its_floor(self, config: Config) -> bool:
        """Whether the configuration's memory floor, every decision at its most frugal, is within the budget."""
        return self.setup(config).frugal_costs.floor_bytes <= self.space.mem_bytes

    def fits(self, config: Config) -> bool:
        """Whether any partition of this configuration might fit the budget (by DP, where it applies:
        exact without memory decisions, a necessary condition with them; else by the memory floor alone)."""
        if not self._fits_at_its_floor(config):
            return False
        costs = self.setup(config).frugal_costs
        try:
            check_exact(costs, decisions_allowed=True)
        except ValueError:
            return True  # several stages share a slot: the ILP decides
        lowest = self._min_peak(config, frugal=True)
        return lowest is not None and lowest.peak_bytes <= self.space.mem_bytes

    def seed(self, ranked: Sequence[Config]) -> Candidate | None:
        """A first plan, before any ILP, to cut the first ILPs off: of the first SEED_CONFIGS
        configurations (in order of their lower bound) that may fit, the fastest whose least-memory
        partition keeping every activation fits; if none does, the fastest whose most frugal partition
        fits with every unit recomputed (or swapped). Not optimal; the ILP of its configuration then
        improves it or proves that nothing does.

        Data parallelism alone (one stage, no tiles) is tried too, wherever it ranks: its one partition is
        its optimum, found without an ILP, and a configuration's bound can be far below its plans (tiled
        pipelines of ResNet-152 on 16 GPUs were bounded at 98 ms and planned at 230 ms and more, ranked
        ahead of data parallelism's 160 ms), so a time limit could end a search before it reached the plan
        every user tries first."""
        ranked_seed = self._seed(ranked, self._kept_seed) or self._seed(ranked, self._frugal_seed)
        whole = [config for config in ranked if config.num_stages == 1 and not config.spatial]
        whole_seed = self._seed(whole, self._kept_seed, limit=len(whole))
        return min((c for c in (ranked_seed, whole_seed) if c is not None), key=lambda c: c.objective_ms,
                   default=None)

    def _seed(self, ranked: Sequence[Config], plan_of: Callable[[Config], Candidate | None], *,
              limit: int | None = None) -> Candidate | None:
        """The fastest of ``plan_of`` over the first ``limit`` (default SEED_CONFIGS) configurations that may fit and
        hold one part per slot (the least-memory partitions are the dynamic programs', which need that)."""
        best: Candidate | None = None
        tried, limit = 0, SEED_CONFIGS if limit is None else limit
        for config in ranked:  # (by bound where the time limit allowed ranking them: Search.ranked)
            if tried == limit:
                break
            if config.virtual_stages > 1 or config.schedule is ScheduleKind.GEMS_MASTER:  # parts sharing ranks: no
                continue  # dynamic program gives their partitions
            if best is not None and self._known_bound(config) >= best.objective_ms or not self.fits(config):
                continue
            tried += 1
            candidate = plan_of(config)
            if candidate is not None and (best is None or candidate.objective_ms < best.objective_ms):
                best = candidate
        return best

    def _kept_seed(self, config: Config) -> Candidate | None:
        """``config``'s least-memory partition keeping every activation, if it fits."""
        lowest = self._min_peak(config, frugal=False)
        return None if lowest is None else self._seed_candidate(config, lowest.evaluation, "DP (least-memory split)")

    def _frugal_seed(self, config: Config) -> Candidate | None:
        """``config``'s most frugal partition with every unit recomputed (or, without recompute, swapped),
        if that fits."""
        costs = self.setup(config).decided
        lowest = self._min_peak(config, frugal=True)
        if costs is None or lowest is None:
            return None
        every, none = (1.0,) * costs.num_units, (0.0,) * costs.num_units
        tiers = costs.problem.tiers
        decisions = Decisions(every, none) if tiers.recompute else Decisions(none, every)
        how = "recomputed" if tiers.recompute else "swapped"
        return self._seed_candidate(config, evaluate(costs, lowest.cuts, decisions),
                                    f"DP (least-memory split, every unit {how})")

    def _seed_candidate(self, config: Config, evaluation: Evaluation, solver: str) -> Candidate | None:
        if not (evaluation.fits(self.space.mem_bytes) and evaluation.capacity_fits):
            return None
        slot = max(range(len(evaluation.slot_peak_bytes)), key=lambda s: evaluation.slot_peak_bytes[s])
        share = evaluation.slot_peak_bytes[slot] / self.space.mem_bytes
        return Candidate(self.setup(config), evaluation, evaluation.step_ms, SolveStatus.FEASIBLE, solver,
                         float("nan"), f"memory of slot {slot} ({share:.0%} of the budget)", seed=True)

    def solve_kept(self, config: Config, time_limit_s: float, cutoff_ms: float | None,
                   seed: Candidate | None = None) -> tuple[Candidate | None, bool, float]:
        """The best partition of ``config`` keeping every saved activation (None if none fits or beats
        ``cutoff_ms``; ``seed``, a plan of this configuration, if the ILP finds none better), whether
        recompute and swap should be decided for it (offload is on and that plan is missing or its
        memory binds), and the seconds it took."""
        setup = self.setup(config)
        start = time.perf_counter()
        kept = None
        if setup.decided_problem is None or self._kept_fits(config):
            window = _shared_slot_window(setup.costs)
            proven = _cannot_beat(setup.costs, cutoff_ms, window)  # then the ILP would find nothing either
            if window is not None:
                time_limit_s = min(time_limit_s, SHARED_SLOT_SOLVE_S)
            result = None if proven else solve_partition(setup.costs, time_limit_s=time_limit_s, cutoff_ms=cutoff_ms,
                                                         window=window)
            if result is not None and result.cuts is not None:
                kept = Candidate(setup, evaluate(setup.costs, result.cuts), result.objective, result.status,
                                 result.solver, result.gap, result.binding, local=window is not None)
            elif seed is not None and (proven or result.status is SolveStatus.INFEASIBLE) and cutoff_ms is not None \
                    and cutoff_ms >= seed.objective_ms:  # it is proven that nothing beats the seed
                kept = dataclasses.replace(seed, status=SolveStatus.OPTIMAL, gap=0.0,
                                           solver=seed.solver if result is None else result.solver)
            else:
                kept = seed
        binds = kept is None or kept.evaluation.peak_mem_bytes >= DECIDE_WHEN_MEMORY_AT * self.space.mem_bytes
        return kept, setup.decided_problem is not None and binds, time.perf_counter() - start

    def solve_decided(self, config: Config, kept: Candidate | None, time_limit_s: float,
                      cutoff_ms: float | None) -> tuple[Candidate | None, float]:
        """The best partition of ``config`` with recompute and swap decided per unit in the same ILP
        as the cuts, around ``kept``'s cuts (see :meth:`_decide`), if it beats ``cutoff_ms``."""
        start = time.perf_counter()
        cutoff = cutoff_ms if kept is None else min(cutoff_ms or kept.objective_ms, kept.objective_ms)
        decided = self._decide(self.setup(config), kept.evaluation.cuts if kept else None, time_limit_s, cutoff)
        return decided, time.perf_counter() - start

    def _decide(self, setup: Setup, cuts: tuple[int, ...] | None, time_limit_s: float,
                cutoff_ms: float | None) -> Candidate | None:
        """The ILP with per-unit recompute and swap and the cuts, each cut free within a window of
        units around ``cuts`` (or the most frugal partition's), moved while the best plan's cuts
        reach a window's edge.

        Recompute and swap shares come out as shares of units; a unit with any share is recomputed
        (or else swapped) whole, which needs no more memory than the ILP's plan but may cost more
        time, so the plan is evaluated with whole units; if that broke a memory limit, the window is
        solved again with whole units only (exact).
        """
        costs = setup.decided
        assert costs is not None
        deadline = time.perf_counter() + time_limit_s
        if cuts is None:
            cuts = min_peak_partition(costs).cuts if _shared_slot_window(costs) is None else even_cuts(costs)
        best: Candidate | None = None
        for _ in range(DECISION_ROUNDS):
            window = _window(costs, cuts)
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or _cannot_beat(costs, cutoff_ms, window):
                break
            result = solve_partition(costs, time_limit_s=min(remaining, DECISION_SOLVE_S), cutoff_ms=cutoff_ms,
                                     window=window)
            if result.cuts is None or (cutoff_ms is not None and result.objective >= cutoff_ms):
                break  # whole units cost at least the shares: this window cannot beat the cutoff
            evaluation = evaluate(costs, result.cuts, whole_units(result.decisions))
            if not (evaluation.fits(self.space.mem_bytes) and evaluation.capacity_fits):
                result = solve_partition(costs, time_limit_s=min(max(1.0, deadline - time.perf_counter()),
                                                                 DECISION_SOLVE_S),
                                         cutoff_ms=cutoff_ms, integral=True, window=window)
                if result.cuts is None:
                    break
                evaluation = evaluate(costs, result.cuts, whole_units(result.decisions))
            candidate = Candidate(setup, evaluation, evaluation.step_ms, result.status, result.solver,
                                  result.gap, result.binding,
                                  local=any(low > -1 or high < costs.num_units - 2 for low, high in window))
            if best is None or candidate.objective_ms < best.objective_ms:
                best = candidate
            at_edge = any(cut in edges and edges[0] != edges[1] and cut not in (-1, costs.num_units - 2)
                          for cut, edges in zip(result.cuts, window))
            if not at_edge or result.cuts == cuts:
                break
            cuts = result.cuts
        return best

    def ranked(self, configs: Sequence[Config], deadline: float) -> list[Config]:
        """``configs`` by lower bound (ties in listed order), bounded until ``deadline`` (time.perf_counter()):
        those it did not reach follow in listed order, unbounded. Bounding every configuration of ResNet-152 on
        16 GPUs at a 200 MB budget (1,100, each costing its programs and terms) took 10-20 s, as long as a short
        time limit, and the search stops at its limit once it has a plan."""
        bounded: list[Config] = []
        for config in configs:
            if time.perf_counter() > deadline:
                break
            self.lower_bound(config)
            bounded.append(config)
        return sorted(bounded, key=lambda config: round(self.lower_bound(config), 9)) + list(configs[len(bounded):])

    def _known_bound(self, config: Config) -> float:
        """The best bound computed so far for ``config`` without computing more (-inf where none was): what a
        search that ran out of time counts as possibly better than its plan."""
        return self._decided_bounds.get(config, self._bounds.get(config, float("-inf")))

    def lower_bound(self, config: Config) -> float:
        """Step time no partition of this configuration can beat (planner/search/terms.py; cached)."""
        if config not in self._bounds:
            self._bounds[config] = lower_bound(self.setup(config).costs)
        return self._bounds[config]

    def decided_bound(self, config: Config, enough_ms: float = float("inf")) -> float:
        """Step time no partition of this configuration beats with any recompute and swap: the larger of
        :meth:`lower_bound` and, where the DPs apply, the time its parts must pay to free the memory
        beyond the budget (planner/search/oracle.py: decided_step_floor; cached). Asked with ``enough_ms``
        (the search's best step so far, which only falls) it may stop once it reaches that: below the
        tightest bound then, but still at or above every later best, so it prunes alike."""
        if config not in self._decided_bounds:
            bound = self.lower_bound(config)
            if bound >= enough_ms:  # enough already: no dynamic program
                return bound
            costs = self.setup(config).decided
            try:
                self._decided_bounds[config] = max(bound, decided_step_floor(costs, enough_ms)) if costs else bound
            except ValueError:  # several stages share a slot
                self._decided_bounds[config] = bound
        return self._decided_bounds[config]

    def infeasible(self, configs: Sequence[Config]) -> PlanInfeasible:
        """The error for a budget nothing fits: the smallest memory the most frugal layout needs (of a layout
        with one part per slot, which the exact dynamic programs measure: a family holding several parts per
        slot is measured as 1F1B on as many ranks)."""
        one_per_slot = [c for c in configs if _shared_slot_window(self.setup(c).costs) is None]
        if not one_per_slot:
            return self._shared_slots_infeasible(configs)
        frugal = min(one_per_slot, key=lambda c: (-c.num_stages, c.micro_batch_size,
                                             sum(self.setup(c).problem.in_flight),
                                             c.state.optimizer is StateTier.GPU, c.state.optimizer is StateTier.HOST,
                                             -c.state.zero_stage, not c.state.params_on_host,
                                             c.state.grads_on_host))
        # sending the gradients to the host spares them but holds a cast of the largest: whichever needs less
        sent = dataclasses.replace(frugal, state=dataclasses.replace(frugal.state, grads_on_host=True))
        candidates = [frugal, *([sent] if sent != frugal and sent in one_per_slot else [])]
        setup, lowest = min(((self.setup(c), min_peak_partition(self.setup(c).costs)) for c in candidates),
                            key=lambda pair: pair[1].peak_bytes)
        if lowest.peak_bytes <= self.space.mem_bytes:  # the GPUs would fit it: host memory or NVMe do not
            return capacity_error(setup, evaluate(setup.costs, lowest.cuts), lowest.peak_bytes)
        decided = self._fits_but_for_capacity(setup)
        if decided is not None:  # with memory decisions the GPUs would fit it: host memory or NVMe do not
            return capacity_error(setup, decided, lowest.peak_bytes)
        return infeasible_error(setup, self._budget(), self.space.gpus, self.device.name, self.space.reserve,
                                self._decided_floor(configs))

    def _decided_floor(self, configs: Sequence[Config]) -> int | None:
        """A memory no plan of ``configs`` fits below, with every memory decision at its most frugal: per
        configuration the exact least peak of its partitions where one part is on each slot, else the window
        floor over every partition (configurations taken by their memory floor, lowest first, until it reaches
        the least found); None where the search may make no memory decision (then the budget keeping every
        activation is the least)."""
        if all(self.setup(c).decided is None for c in configs):
            return None
        floors = sorted(((self.setup(c).frugal_costs.floor_bytes, c) for c in configs), key=lambda pair: pair[0])
        least = float("inf")
        for floor, config in floors:
            if floor >= least:
                break
            costs = self.setup(config).frugal_costs
            if _shared_slot_window(costs) is None:
                least = min(least, min_peak_partition(costs).peak_bytes)
            else:  # each cut anywhere its part can end
                anywhere = tuple((cut, costs.num_units - costs.num_parts + cut) for cut in range(costs.num_parts - 1))
                least = min(least, window_memory_floor(costs, anywhere))
        return round(least)

    def _fits_but_for_capacity(self, setup: Setup) -> Evaluation | None:
        """``setup``'s fastest plan with memory decisions were each node's host memory and NVMe unbounded,
        where it fits the GPUs but not the real host memory or NVMe (what they must grow to); else None."""
        problem = setup.decided_problem
        if problem is None:
            return None
        unbounded = dataclasses.replace(problem.tiers, host_mem_bytes=UNBOUNDED_BYTES, nvme_bytes=UNBOUNDED_BYTES)
        result = solve_partition(cost_model(dataclasses.replace(problem, tiers=unbounded)),
                                 time_limit_s=DECISION_SOLVE_S)
        if result.cuts is None:
            return None
        evaluation = evaluate(setup.decided, result.cuts, whole_units(result.decisions))
        return None if evaluation.capacity_fits or not evaluation.fits(self.space.mem_bytes) else evaluation

    def _shared_slots_infeasible(self, configs: Sequence[Config]) -> PlanInfeasible:
        """Only families holding several parts per rank were asked for and none fits: what the most frugal
        configuration's even cuts need with every unit recomputed (or swapped) where allowed, a budget that
        surely fits (no exact program measures such layouts)."""
        def need(config: Config) -> int:
            costs = self.setup(config).frugal_costs
            every, none = (1.0,) * costs.num_units, (0.0,) * costs.num_units
            tiers = costs.problem.tiers
            decisions = (Decisions(every, none) if tiers.recompute else Decisions(none, every)) if costs.decides else None
            return evaluate(costs, even_cuts(costs), decisions).peak_mem_bytes
        frugal = min(configs, key=need)
        families = sorted({c.schedule.value for c in configs})
        give = self.space.reserve.mem_for(need(frugal))  # the usable bytes it needs, with the reserve kept free
        return PlanInfeasible(
            f"no plan of schedules {families} fits {self._budget()} per GPU on {self.space.gpus} x {self.device.name}: "
            f"their ranks hold several parts each, and the most frugal ({frugal.describe()}) fits in "
            f"{format_bytes(need(frugal))} on even cuts. Give mem >= {format_bytes(give, at_least=True)}, or add "
            f"schedules gpipe or 1f1b", min_mem_bytes=give, binding="memory")

    def _budget(self) -> str:
        usable, reserve = self.space.mem_bytes, self.space.reserve_bytes
        if not reserve:
            return format_bytes(usable)
        return (f"{format_bytes(usable)} ({format_bytes(usable + reserve)} less {format_bytes(reserve)} "
                f"reserved)")


OFFLOAD_MUST_GAIN = 0.01
"""A plan with memory decisions wins over the best plan keeping everything on the GPU only when it is
predicted at least this much faster (a 0.3% gain is not worth sharded state or host copies)."""

TILES_MUST_GAIN = 0.05
"""A plan tiling the image wins over the best plan without tiles only when it is predicted at least this
much faster: the roofline sees neither the lower efficiency of kernels on small tiles nor the launch
cost of one halo exchange per layer beyond its latency."""

DECIDE_WHEN_MEMORY_AT = 0.97
"""Recompute and swap are decided for a configuration whose best plan keeping every activation uses at
least this share of the budget (or has none): below it, they cannot buy a faster plan."""

UNBOUNDED_BYTES = 2**62
"""Host memory or NVMe without limit: what a node would need, asked of a plan that fits the GPUs otherwise."""

DECISION_SOLVE_S = 2.0
"""Time limit of one ILP with memory decisions (its best plan then may be unproven, and says so)."""

DECISION_S = 3.0
"""Time limit of all the ILPs with memory decisions of one configuration."""

SEED_CONFIGS = 8
"""How many configurations that may fit the search tries for a first plan before any ILP (Search.seed)."""

DECISION_WINDOW_UNITS = 8
"""How far (in units) each cut may move either way in one ILP with memory decisions: wider windows
found no better plans on the zoo but let one ILP run into its time limit on deep networks."""

FAMILY_SLACK = 0.1
"""How far above the best plan so far a plan of a family costed from its programs (interleaved 1F1B,
GEMS-MASTER, ZB-H1) is still solved: their step models are off the simulated step by up to about this
much (tests/unit/test_family_search.py measures it), so a plan they rank second may simulate first."""

FINALISTS = 12
"""At most this many plans within FAMILY_SLACK of the best one are simulated to pick the winner (with
the best plan of each schedule family)."""

SHARED_SLOT_SOLVE_S = 3.0
"""Time limit of the ILP keeping every activation of a configuration whose slots hold several parts."""

DECISION_ROUNDS = 3
"""How many times the window of the ILP with memory decisions moves after the best plan's cuts."""


def _close(solved: Sequence[Candidate]) -> list[Candidate]:
    """Of ``solved`` (the best first), the first FINALISTS plans within FAMILY_SLACK of the best, each once: a
    configuration's ILP with memory decisions may return the plan its ILP keeping every activation found
    (same cuts, same step), which would otherwise take a second finalist's place."""
    close: list[Candidate] = []
    seen: set[tuple] = set()
    for candidate in solved:
        key = (candidate.setup.config, candidate.evaluation.cuts, round(candidate.objective_ms, 9))
        if candidate.objective_ms > (1 + FAMILY_SLACK) * solved[0].objective_ms or key in seen:
            continue
        seen.add(key)
        close.append(candidate)
        if len(close) == FINALISTS:
            break
    return close


def _schedule_key(config: Config) -> tuple:
    """What ``config``'s programs depend on (not its state mode)."""
    return (config.schedule, config.num_stages, config.num_microbatches, config.data_parallel, config.stage_tiles,
            config.virtual_stages)


def _shape(config: Config) -> dict[str, Any]:
    """The generator options of ``config``'s family beyond the part and micro-batch counts."""
    if config.schedule is ScheduleKind.INTERLEAVED_1F1B:
        return {"virtual_stages": config.virtual_stages}
    return {"tiles": config.stage_tiles} if config.spatial else {}


def _activations(decisions: Decisions | None) -> str:
    if decisions is None:
        return ""
    recomputed, swapped = round(sum(decisions.recompute)), round(sum(decisions.swap))
    said = [f"recomputing {recomputed} units" if recomputed else "", f"swapping {swapped} units" if swapped else ""]
    return " and ".join(text for text in said if text)


def _cannot_beat(costs: CostModel, cutoff_ms: float | None, window: Window | None = None) -> bool:
    """Whether the decided step floor (over ``window``'s partitions, if given) proves that no plan of
    ``costs`` beats ``cutoff_ms``: the ILP would find nothing, a DP in milliseconds instead of a solve.
    Without memory decisions the floor is the objective's over the partitions that fit. Where several
    stages share a slot the DP does not apply: a window no plan fits in (its memory floor above the budget)
    has nothing to beat anything with, and the shared slots' floor (the time freeing each slot's excess takes,
    relaxed into a sum over parts) may reach the cutoff."""
    try:
        return cutoff_ms is not None and decided_step_floor(costs, cutoff_ms, window) >= cutoff_ms
    except ValueError:  # several stages share a slot
        if window is None:
            return False
        return window_memory_floor(costs, window) > costs.problem.mem_bytes or (
            cutoff_ms is not None and shared_slot_step_floor(costs, window, cutoff_ms) >= cutoff_ms)


def _cutoff(config: Config, best_ms: float | None) -> float | None:
    """The step a plan of ``config`` must beat to be solved and kept: the best so far, or FAMILY_SLACK
    above it for a family whose step model is estimated from its programs, and for pure data parallelism
    (one stage on every GPU), whose all-reduce overlaps its last backward in the simulator but not in the
    step model (the simulator then chooses among the finalists: planner/assemble.py)."""
    pure_data_parallel = config.num_stages == 1 and config.data_parallel > 1
    if best_ms is None or (config.schedule.closed_form and not pure_data_parallel):
        return best_ms
    return best_ms * (1 + FAMILY_SLACK)


def even_cuts(costs: CostModel) -> tuple[int, ...]:
    """The cuts that give every part about the same compute (forward and backward) per micro-batch.

    >>> from planner.search.problem import Unit
    >>> problem = type("P", (), {"units": [Unit((str(i),), 1.0, 2.0, 0, 0, 0, 0) for i in range(8)]})
    >>> even_cuts(type("C", (), {"problem": problem, "num_parts": 4, "num_units": 8})())
    (1, 3, 5)
    """
    compute = list(itertools.accumulate(unit.fwd_ms + unit.bwd_ms for unit in costs.problem.units))
    cuts: list[int] = []
    for part in range(1, costs.num_parts):
        share = compute[-1] * part / costs.num_parts
        cut = next(unit for unit, done in enumerate(compute) if done >= share - 1e-12)
        lowest = cuts[-1] + 1 if cuts else 0
        cuts.append(min(max(cut, lowest), costs.num_units - 1 - (costs.num_parts - part)))
    return tuple(cuts)


def _window(costs: CostModel, cuts: tuple[int, ...]) -> Window:
    """Each cut free within a few units either way (fewer the more parts share the units)."""
    width = max(2, min(DECISION_WINDOW_UNITS, costs.num_units // (2 * costs.num_parts)))
    return tuple((max(-1, cut - width), min(costs.num_units - 2, cut + width)) for cut in cuts)


def _shared_slot_window(costs: CostModel) -> Window | None:
    """Where a slot holds several parts (interleaved 1F1B, GEMS-MASTER: no dynamic program prunes or seeds
    them, and their ILP grows with the parts), the window around the even cuts its ILP is solved in;
    None where every slot holds one part (the ILP over every partition)."""
    try:
        check_exact(costs, decisions_allowed=True)
    except ValueError:
        return _window(costs, even_cuts(costs))
    return None


def whole_units(decisions: Decisions | None) -> Decisions | None:
    """Each unit with any recompute share recomputed whole, else with any swap share swapped whole."""
    if decisions is None:
        return None
    recompute = tuple(1.0 if share > 1e-6 else 0.0 for share in decisions.recompute)
    swap = tuple(1.0 if share > 1e-6 and not again else 0.0 for share, again in zip(decisions.swap, recompute))
    return Decisions(recompute, swap)
