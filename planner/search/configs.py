"""The search space: a request's knobs, and every configuration (stages x replicas x micro-batching
x schedule x where model state lives x whether stage 0 runs on image tiles).

Every schedule family is a configuration of its own where its generator accepts the numbers:
interleaved 1F1B puts v model parts on each pipeline rank (v in VIRTUAL_STAGES, the micro-batch
count a multiple of the ranks), GEMS-MASTER mirrors two copies of an even number of parts (an even
micro-batch count), ZB-H1 splits every backward; only GPipe and 1F1B run stage 0 on image tiles.

A configuration uses S x D GPUs, or (S - 1 + P) x D with stage 0 on P tiles per replica. It normally uses all G it is given; when the global batch B is
smaller than G, at most B GPUs can work at once (each sample is in one place at a time), so plans
on fewer GPUs (every divisor of G) are considered too and win when they are at least as fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cost_models.errors import InvalidArgument
from cost_models.memory import Optimizer, Precision
from cost_models.units import plural
from planner.budget import Reserve
from planner.plan.kinds import ScheduleKind
from planner.search.problem import ON_GPU, Offload, SpatialChoice, StateMode, describe_tiles, state_modes


@dataclass(frozen=True)
class SearchSpace:
    """The discrete knobs and fixed inputs of one planning request."""

    gpus: int  # available; a plan may use fewer when the batch cannot feed them all
    gpus_per_node: int
    mem_bytes: int  # per GPU, what a plan may use (the budget less the reserve)
    global_batch_size: int
    optimizer: Optimizer
    precision: Precision
    schedules: tuple[ScheduleKind, ...]
    micro_batch_sizes: tuple[int, ...] | None = None  # None: every divisor
    num_stages: tuple[int, ...] | None = None  # None: every divisor of the GPUs used
    max_units: int = 160
    time_limit_s: float = 60.0
    reserve: Reserve = Reserve()  # kept free on every GPU; mem_bytes is what is left
    reserve_bytes: int = 0
    data_parallel: tuple[int, ...] | None = None  # None: every degree the batch allows
    offload: frozenset[Offload] = frozenset(Offload)  # the memory decisions the search may make
    host_mem_bytes: int | None = None  # per node (None: the device's share times gpus_per_node)
    nvme_bytes: int | None = None  # per node (None: likewise)
    spatial: bool = True  # whether stage 0 may run on image tiles (where the model and precision allow)


@dataclass(frozen=True)
class Config:
    num_stages: int
    data_parallel: int
    micro_batch_size: int
    num_microbatches: int
    schedule: ScheduleKind
    state: StateMode = ON_GPU  # where every stage keeps its model state
    spatial: tuple[SpatialChoice, ...] = ()  # the leading stages on image tiles, one tiling each
    virtual_stages: int = 1  # model parts per pipeline rank (interleaved 1F1B); num_stages counts parts

    @property
    def gpus(self) -> int:
        return self.pipeline_ranks * self.data_parallel

    @property
    def pipeline_ranks(self) -> int:
        """Ranks of one replica (its pipeline)."""
        return sum(self.stage_tiles) // self.virtual_stages

    @property
    def stage_tiles(self) -> tuple[int, ...]:
        """Ranks of each stage per replica."""
        return tuple(choice.parts for choice in self.spatial) + (1,) * (self.num_stages - len(self.spatial))

    def describe(self) -> str:
        """The configuration in the words of its plan's title (planner.plan.Layout.describe): GEMS-MASTER's
        ``num_stages`` parts are two copies' stages.

        >>> Config(2, 4, 2, 2, ScheduleKind.GEMS_MASTER).describe()
        '4 stages of 2 parts on 2 ranks x 4 replicas, 2 micro-batches of 2, gems-master'
        """
        where = self.state.describe()
        stages = plural(self.num_stages, "stage")
        tiles = f" ({describe_tiles(self.spatial)})" if self.spatial else ""
        if self.virtual_stages > 1:
            tiles = f" on {plural(self.pipeline_ranks, 'rank')} ({self.virtual_stages} per rank)"
        if self.schedule is ScheduleKind.GEMS_MASTER:  # two copies of the parts, in opposite directions
            stages = f"{plural(2 * self.num_stages, 'stage')} of {plural(self.num_stages, 'part')}"
            tiles = f" on {plural(self.pipeline_ranks, 'rank')}"
        return (f"{stages}{tiles} x {plural(self.data_parallel, 'replica')}, "
                f"{plural(self.num_microbatches, 'micro-batch', 'micro-batches')} of "
                f"{self.micro_batch_size}, {self.schedule.value}" + (f", {where}" if where else ""))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def gpu_counts(space: SearchSpace) -> list[int]:
    """The GPU counts plans may use, fewest first: all G; every divisor of G when the batch is smaller
    than G; and S x D when both are fixed (num_stages and data_parallel) and divide G."""
    counts = set(divisors(space.gpus)) if space.global_batch_size < space.gpus else {space.gpus}
    if space.num_stages and space.data_parallel:
        counts |= {s * d for s in space.num_stages for d in space.data_parallel if space.gpus % (s * d) == 0}
    return sorted(counts)


def configurations(space: SearchSpace, max_stages: int,
                   tilings: tuple[SpatialChoice, ...] = ()) -> list[Config]:
    """Every (S, D, micro-batch, schedule) on a GPU count of :func:`gpu_counts` that divides the batch;
    and with each of ``tilings`` (the tile grids the model's image allows) for stage 0, or one for stage 0
    and one of half its tiles for stage 1, every (S, D) using such a count with an ordinary stage after."""
    configs = []
    for gpus in gpu_counts(space):
        for stages in divisors(gpus):
            replicas = gpus // stages
            if stages > max_stages or space.global_batch_size % replicas:
                continue
            if (space.num_stages and not any(count % stages == 0 for count in space.num_stages)) or (
                    space.data_parallel and replicas not in space.data_parallel):
                continue
            configs.extend(config for config in _micro_batchings(space, stages, replicas)
                           if config.num_stages <= max_stages  # a part holds at least one unit
                           and (not space.num_stages or config.num_stages in space.num_stages))
        for tiling in tilings:
            configs.extend(_spatial_configs(space, gpus, (tiling,), max_stages))
            for then in tilings:  # two consecutive spatial stages, the second on half the tiles
                if 2 * then.parts == tiling.parts:
                    configs.extend(_spatial_configs(space, gpus, (tiling, then), max_stages))
    if not configs:
        stray = [stages for stages in space.num_stages or () if space.gpus % stages]
        if stray and not tilings:  # only stage 0 on tiles could have used such a stage count
            raise InvalidArgument(f"num_stages {stray} must divide gpus={space.gpus} for a model whose input "
                                  f"cannot be cut into image tiles; choose from {divisors(space.gpus)}")
        closed = tuple(kind for kind in space.schedules if kind.closed_form)
        if closed != space.schedules and (not closed or configurations(
                dataclasses.replace(space, schedules=closed or (ScheduleKind.GPIPE,)), max_stages, tilings)):
            raise InvalidArgument(_family_message(space))
        raise InvalidArgument(_batch_message(space))
    return configs


def _family_message(space: SearchSpace) -> str:
    """Why the requested schedule families have no configuration where GPipe would have one."""
    needs = {ScheduleKind.INTERLEAVED_1F1B: "2+ pipeline ranks and a micro-batch count that is a multiple of "
                                            "them (and 2+ units per rank)",
             ScheduleKind.GEMS_MASTER: f"an even number (2+) of pipeline ranks and an even micro-batch count "
                                       f"of at most {GEMS_MAX_ROUNDS} per rank",
             ScheduleKind.ZB_H1: "2+ pipeline ranks",
             ScheduleKind.WPIPE: "2+ pipeline ranks"}
    said = "; ".join(f"{kind.value} needs {needs[kind]}" for kind in space.schedules if kind in needs)
    return (f"no configuration of schedules {[kind.value for kind in space.schedules]} fits {space.gpus} GPUs and "
            f"batch size {space.global_batch_size}: {said}; change the micro-batch sizes or the batch size, "
            f"or add schedules gpipe or 1f1b (valid: {', '.join(kind.value for kind in ScheduleKind)})")


def _spatial_configs(space: SearchSpace, gpus: int, tilings: tuple[SpatialChoice, ...],
                     max_stages: int) -> list[Config]:
    """The configurations on ``gpus`` whose leading stages run on ``tilings``, followed by at least one
    ordinary stage, per replica."""
    configs: list[Config] = []
    for replicas in divisors(gpus):
        stages = gpus // replicas - sum(tiling.parts for tiling in tilings) + len(tilings)
        if stages <= len(tilings) or stages > max_stages or space.global_batch_size % replicas:
            continue
        if (space.num_stages and stages not in space.num_stages) or (
                space.data_parallel and replicas not in space.data_parallel):
            continue
        configs.extend(_micro_batchings(space, stages, replicas, tilings))
    return configs


def _micro_batchings(space: SearchSpace, stages: int, replicas: int,
                     spatial: tuple[SpatialChoice, ...] = ()) -> list[Config]:
    """Every micro-batching, schedule family and state mode of ``stages`` pipeline ranks per replica."""
    per_replica = space.global_batch_size // replicas
    sizes = space.micro_batch_sizes or tuple(divisors(per_replica))
    modes = (ON_GPU,) if spatial else state_modes(space.offload, replicas > 1)  # tiles keep their state
    return [Config(stages * virtual, replicas, micro, per_replica // micro, schedule, state, spatial, virtual)
            for micro in sizes if per_replica % micro == 0 for schedule in space.schedules
            for virtual in _family_shapes(schedule, stages, per_replica // micro, bool(spatial))
            for state in ((ON_GPU,) if schedule.stale_weights else modes)
            if not (state.grads_on_host and schedule is ScheduleKind.GEMS_MASTER)  # (its parts have two copies)
            and not (state.zero_stage == 3 and (schedule.splits_backward  # (a W gathers no layer: runtime/checks.py)
                                                 or schedule is ScheduleKind.GEMS_MASTER))]  # (mirrors gather apart)


def _family_shapes(schedule: ScheduleKind, ranks: int, num_microbatches: int, spatial: bool) -> tuple[int, ...]:
    """The virtual stages per rank with which ``schedule`` can run ``ranks`` pipeline ranks and
    ``num_microbatches`` micro-batches (none: it cannot; 1: no virtual stages)."""
    if schedule in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B):
        return (1,)
    if spatial or ranks < 2:  # one rank per replica: there is no bubble for the other families to fill
        return ()
    if schedule is ScheduleKind.INTERLEAVED_1F1B:
        return VIRTUAL_STAGES if num_microbatches % ranks == 0 else ()
    if schedule is ScheduleKind.GEMS_MASTER:
        fills = num_microbatches <= GEMS_MAX_ROUNDS * ranks
        return (1,) if ranks % 2 == 0 and num_microbatches % 2 == 0 and fills else ()
    if schedule is ScheduleKind.WPIPE:
        return (2,)  # two groups of parts, one part of each per rank
    return (1,)  # zb-h1


GEMS_MAX_ROUNDS = 2
"""GEMS-MASTER is searched with at most this many micro-batches per pipeline rank: its second copy fills
the bubble of a short pipeline, but beyond about two rounds its replayed step on balanced parts exceeds
1F1B's (tests/unit/test_family_search.py) while it holds two copies of the model state."""

VIRTUAL_STAGES = (2, 3, 4)
"""Model parts per rank the search tries for interleaved 1F1B: more shrinks the bubble by as much but
sends as many more activations, and the ranking cost grows with the parts."""


def _batch_message(space: SearchSpace) -> str:
    sizes = f" into micro-batches of {list(space.micro_batch_sizes)}" if space.micro_batch_sizes else ""
    stages = f" with {list(space.num_stages)} stages" if space.num_stages else ""
    replicas = f" and {list(space.data_parallel)} replicas" if space.data_parallel else ""
    return (f"batch size {space.global_batch_size} cannot be split over any data-parallel degree "
            f"dividing {space.gpus} GPUs{stages}{replicas}{sizes}; use a batch size divisible by the "
            f"data-parallel degree times the micro-batch size (e.g. a multiple of {space.gpus}), "
            f"and stage counts and data-parallel degrees whose product divides the GPU count")


def gpus_note(space: SearchSpace, used: int) -> str:
    """Why a plan uses fewer GPUs than it was given ("" when it uses them all)."""
    if used == space.gpus:
        return ""
    if space.global_batch_size < space.gpus:
        return (f"uses {used} of {space.gpus} GPUs: a batch of {space.global_batch_size} keeps at most "
                f"{space.global_batch_size} busy at once, and no plan on more GPUs was faster")
    return f"uses {used} of {space.gpus} GPUs, as the stage count and data-parallel degree asked"
