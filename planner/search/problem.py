"""The partition problem: a costed graph coarsened into units, and one configuration's numbers.

A *unit* is a run of consecutive nodes (topological order) that always share a part; cuts fall
only between units, at points where few bytes cross. Every number the cost terms
(planner/search/terms.py) are made of comes from here, per micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from cost_models.comm import (
    allreduce_link,
    p2p_coefficients,
    p2p_link,
    p2p_post_ms,
    ring_allreduce_coefficients,
    same_node,
)
from cost_models.cpu_device import CPU_NAME
from cost_models.device_spec import BYTES_PER_GB, OptimizerStepCost
from cost_models.devices import DeviceSpec
from cost_models.errors import InvalidArgument
from cost_models.estimation import CostTable
from cost_models.graph.ir import LayerGraph, NodeKind
from cost_models.memory import Optimizer, Precision, model_state_bytes
from cost_models.spatial import TileCost, TileGeometry
from planner.plan.kinds import ScheduleKind
from planner.plan.layout import Layout
from planner.plan.parts import StateTier, TiedSum
from planner.plan.spatial import Slicing, grid_shape
from planner.schedules.balanced import BalancedStep
from planner.search.working import loss_bytes, node_working

if TYPE_CHECKING:
    from planner.search.configs import SearchSpace


@dataclass(frozen=True)
class Unit:
    """Consecutive nodes kept together; costs per micro-batch."""

    nodes: tuple[str, ...]
    fwd_ms: float
    bwd_ms: float
    state_bytes: int  # weights + gradients + optimizer state + buffers of parameters only it uses
    grad_bytes: int  # gradients of those parameters (all-reduced across data-parallel replicas)
    activation_bytes: int  # saved for backward, per micro-batch in flight
    transient_bytes: int  # largest single-node working set (output and its gradient)
    shared: tuple[int, ...] = ()  # indices into PipelineProblem.shared
    weight_bytes: int = 0  # of state_bytes: the weights (in the training dtype)
    optimizer_bytes: int = 0  # of state_bytes: fp32 master weights and optimizer state
    param_numel: int = 0  # elements of those parameters (what an optimizer step touches)
    offloadable_bytes: int = 0  # what recomputing or swapping it releases: what its nodes last save
    input_bytes: int = 0  # what a checkpoint of this unit keeps: the activations alive where it starts
    weight_grad_ms: float = 0.0  # what a split backward's W takes (its parameters' gradients; NodeCost)
    split_extra_ms: float = 0.0  # what splitting its backward costs beyond bwd_ms (NodeCost: measured)
    split_kept_bytes: int = 0  # what a split backward's I keeps for its W: its weighted nodes' output gradients
    weight_grad_working_bytes: int = 0  # the most a W of it allocates at once: of the nodes computing with
    # weights, the most one's W allocates (its new weight gradients and the kernel's workspace:
    # planner/search/working.py NodeWorking.weight_grad)
    param_tensors: int = 0  # parameter tensors among them (an optimizer step pays a fixed time per tensor)
    largest_param_numel: int = 0  # of its parameters and the shared ones it uses, the largest's elements
    tied_grad_bytes: int = 0  # gradients of its parameters that several of its nodes use (tied weights)
    accumulating_bytes: int = 0  # working set of a backward adding into existing gradients: a node's output
    # gradient and the new gradient of the parameters it uses (at least transient_bytes)
    node_transient_bytes: int | None = None  # of transient_bytes, the largest node's alone: without the
    # loss's working bytes (None: all of transient_bytes)
    summing_transient_bytes: int = 0  # where its backward may sum a tied weight's partial gradients (a use
    # follows the weight's first here, in it or in a later unit): that first user's working set (0: none)
    largest_own_param_numel: int = 0  # of its own parameters (the shared ones apart), the largest's elements
    # ZeRO-3 gathers each module call's own parameters around its forward and backward (runtime/
    # layer_gathers.py): those that only module calls use, never read through get_attr (the rest are gathered
    # for the whole pass and their gradients summed whole at the step)
    layered_weight_bytes: int = 0  # of weight_bytes: such parameters' weights
    layered_grad_bytes: int = 0  # of grad_bytes: their gradients (reduce-scattered after each layer's backward)
    layered_calls: int = 0  # its module calls with such parameters: one all-gather each per pass
    largest_layer_bytes: int = 0  # the most weight bytes one of those calls gathers

    @property
    def region_transient_bytes(self) -> int:
        """The working set while a recomputed region's backward runs: a node's output and its gradient. The
        loss's working bytes are gone by then (its backward runs first and hands on one output gradient)."""
        return self.transient_bytes if self.node_transient_bytes is None else self.node_transient_bytes


@dataclass(frozen=True)
class SharedParam:
    """A parameter used by several units (e.g. tied embeddings): held once per stage using it."""

    name: str
    state_bytes: int
    grad_bytes: int
    weight_bytes: int = 0
    optimizer_bytes: int = 0
    param_numel: int = 0
    param_tensors: int = 0


@dataclass(frozen=True)
class LinearCost:
    """time_ms = fixed_ms + ms_per_byte * bytes (an alpha-beta link, or a ring all-reduce); a link's
    ``post_ms_per_message`` is what posting one message costs each end's rank (cost_models.comm)."""

    fixed_ms: float
    ms_per_byte: float
    post_ms_per_message: float = 0.0

    def ms(self, nbytes: float) -> float:
        return self.fixed_ms + self.ms_per_byte * nbytes if nbytes > 0 else 0.0


@dataclass(frozen=True)
class StateMode:
    """Where a part keeps its model state: ZeRO-1 or ZeRO-3 over its copies or not, and the optimizer's tier.

    ``zero_stage`` 1 splits the fp32 master weights and optimizer state over the part's copies
    (each steps its shard; the gradient all-reduce becomes a reduce-scatter plus an all-gather of
    the same volume). 3 also splits the weights and gradients its layers own (Unit.layered_weight_bytes): each
    module call all-gathers its weights before its forward and again before its backward, and reduce-scatters
    its gradients after it, every micro-batch (runtime/layer_gathers.py); the rest stay whole. On the host or
    NVMe the optimizer step runs on the host's cores; there
    ``grads_on_host`` also sends each backward's gradients to the host as it makes them, where they add
    up (ZeRO-Offload), so the device holds none between backwards (a part with one copy only); with ZeRO-3
    ``params_on_host`` keeps the weights' shards on the host as well, each layer's gather copying this rank's up
    first (ZeRO-Infinity's parameter offload).
    """

    zero_stage: int
    optimizer: StateTier
    grads_on_host: bool = False
    params_on_host: bool = False  # ZeRO-3 with the step off the GPU: the weights' shards on the host too

    def describe(self) -> str:
        where = {StateTier.GPU: "", StateTier.HOST: "optimizer on host",
                 StateTier.NVME: "optimizer state on NVMe, step on host"}[self.optimizer]
        sharded = f"model state sharded (ZeRO-{self.zero_stage})" if self.zero_stage else ""
        grads = "gradients to host each backward" if self.grads_on_host else ""
        params = "params on host" if self.params_on_host else ""
        return ", ".join(text for text in (sharded, where, grads, params) if text)


ON_GPU = StateMode(0, StateTier.GPU)
"""Everything on the GPU, unsharded: the only mode when offload is off."""


class Offload(str, Enum):
    """The memory decisions a search may make (``plan(offload=...)``)."""

    RECOMPUTE = "recompute"  # per unit: drop saved activations, recompute them in the backward
    SWAP = "swap"  # per unit: saved activations to the host and back
    ZERO = "zero"  # per configuration: model state sharded over replicas (ZeRO-1; ZeRO-3: weights and gradients too)
    HOST = "host"  # per configuration: optimizer state and step on the host
    NVME = "nvme"  # per configuration: optimizer state on NVMe, step on the host
    GRADS = "grads"  # per configuration, with HOST or NVME: gradients to the host each backward (ZeRO-Offload)
    PARAMS = "params"  # per configuration, with ZeRO-3 and HOST or NVME: the weights' shards on the host

    @classmethod
    def parse(cls, offload: bool | Iterable[str | Offload]) -> frozenset[Offload]:
        """True: every decision; False: none; else the named ones (InvalidArgument naming the choices, or what a
        named one needs beside it)."""
        if offload is True:
            return frozenset(cls)
        if offload is False:
            return frozenset()
        try:
            kinds = frozenset(cls(name) for name in offload)  # type: ignore[union-attr]
        except (ValueError, TypeError):
            raise InvalidArgument(f"offload must be True, False or some of {[kind.value for kind in cls]}, "
                                  f"got {offload!r}") from None
        off_gpu = {cls.HOST, cls.NVME} & kinds
        if cls.GRADS in kinds and not off_gpu:
            raise InvalidArgument(f"offload {sorted(kind.value for kind in kinds)} sends gradients to the host "
                                  f"('grads') for an optimizer stepping there; add 'host' or 'nvme'")
        if cls.PARAMS in kinds and not (off_gpu and cls.ZERO in kinds):
            raise InvalidArgument(f"offload {sorted(kind.value for kind in kinds)} keeps ZeRO-3's weight shards on "
                                  f"the host ('params'), which needs 'zero' and the optimizer there; add 'zero' "
                                  f"and 'host' or 'nvme'")
        return kinds


def state_modes(offload: frozenset[Offload], sharded: bool) -> tuple[StateMode, ...]:
    """The modes a configuration may use: ON_GPU always; ZeRO-1 and ZeRO-3 ones only for parts with
    data-parallel copies (``sharded``); host and NVMe ones when allowed, and with them gradients sent to
    the host only for parts without copies (whose gradients are summed on the device), and ZeRO-3's weight shards
    on the host too where ``params`` is allowed."""
    tiers = (StateTier.GPU, *(tier for tier, kind in ((StateTier.HOST, Offload.HOST), (StateTier.NVME, Offload.NVME))
                              if kind in offload))
    zero = (0, 1, 3) if sharded and Offload.ZERO in offload else (0,)
    sent = (StateMode(0, tier, grads_on_host=True) for tier in tiers[1:]) if (
        Offload.GRADS in offload and not sharded) else ()
    hosted = (StateMode(3, tier, params_on_host=True) for tier in tiers[1:]) if (
        3 in zero and Offload.PARAMS in offload) else ()
    return (*(StateMode(stage, tier) for stage in zero for tier in tiers), *sent, *hosted)


@dataclass(frozen=True)
class MemoryTiers:
    """What the search may decide about memory, and what the host and NVMe cost.

    Links are per GPU and per direction; host memory and NVMe are per node (``gpus_per_node``
    GPUs share them).
    """

    recompute: bool  # per unit: may its saved activations be recomputed
    swap: bool  # per unit: may its saved activations be swapped to the host
    state: StateMode  # where every part keeps its model state
    host_link: LinearCost
    nvme_link: LinearCost
    host_step_ms_per_param: float  # an optimizer step on the host's cores, per parameter
    host_sum_ms_per_param: float  # a gradient sent down added into its sum on the host, per parameter
    device_step_ms_per_byte: float  # an optimizer step on the GPU, per byte of state it reads or writes
    host_grad_bytes_per_param: int  # the fp32 (fp64) gradient a host step reads (and each way over the link)
    host_mem_bytes: int  # per node
    nvme_bytes: int  # per node
    gpus_per_node: int
    host_master_bytes_per_param: int = 0  # a master copy the host step needs where the precision has none
    device_step: OptimizerStepCost | None = None  # measured on the device: replaces the per-byte estimate
    host_step: OptimizerStepCost | None = None  # measured on the host's cores (the cpu device: they are its own)
    precision: Precision | None = None  # with the optimizer, what the step's own buffers are costed by
    optimizer: Optimizer | None = None  # (None: a bare problem, whose step costs nothing)

    @property
    def activations(self) -> bool:
        """Whether the ILP decides anything per unit."""
        return self.recompute or self.swap


RECOMPUTE_BLOCK_UNITS = 4
"""A checkpoint region is a run of recomputed units inside one block of this many consecutive units:
long enough that a region's kept inputs are a fraction of what it drops, short enough that what it
rematerialises in its backward stays a block's worth."""


def block_of(unit: int) -> int:
    return unit // RECOMPUTE_BLOCK_UNITS


FREE_LINK = LinearCost(0.0, 0.0)
GPU_ONLY = MemoryTiers(False, False, ON_GPU, FREE_LINK, FREE_LINK, 0.0, 0.0, 0.0, 4, 0, 0, 1)
"""No memory decisions and an optimizer step that costs nothing (what a bare problem means)."""


@dataclass(frozen=True)
class SpatialChoice:
    """A spatial stage on ``parts`` image tiles per replica, cut as ``slicing`` (planner/plan/spatial.py Slicing)."""

    parts: int
    slicing: Slicing

    @property
    def grid_shape(self) -> tuple[int, int]:
        """(rows, cols) of the tile grid."""
        return grid_shape(self.parts, self.slicing)

    def describe(self) -> str:
        return f"{self.parts} tiles ({self.slicing.value})"


def describe_tiles(choices: tuple[SpatialChoice, ...]) -> str:
    """E.g. "stage 0 on 4 tiles (square), stage 1 on 2 tiles (vertical)"."""
    return ", ".join(f"stage {stage} on {choice.describe()}" for stage, choice in enumerate(choices))


@dataclass(frozen=True)
class SpatialPart:
    """A part on image tiles: the problem's units as its slowest tile runs them (planner/search/terms.py
    writes the part's terms from these), and how far a spatial part may reach.

    Only the first ``tileable_units`` units can run on tiles (``stop`` says what ends them). A part
    after the first is costed on the tiles its grid gives the whole image's layers (cut as it is, a
    value it receives splits the same way where image sizes halve evenly).
    """

    choice: SpatialChoice
    units: tuple[Unit, ...]  # per unit of the problem, on the slowest tile (untileable ones as they are)
    tileable_units: int
    stop: str
    fused_groups: tuple[tuple[str, ...], ...] = ()  # runs of nodes costed as fused halo groups (cost_models.fused)
    boundary_bytes: tuple[float, ...] = ()  # per cut after a tileable unit: what crosses it on the largest tile


def spatial_part(choice: SpatialChoice, coarse: Coarsening, geometry: TileGeometry,
                 tiles: Mapping[str, TileCost], fused_groups: tuple[tuple[str, ...], ...] = (),
                 crossing: Mapping[str, float] | None = None) -> SpatialPart:
    """``coarse``'s units on ``choice``'s tiles, from each tileable node's cost on the slowest tile (a
    member of ``fused_groups`` costed as its group runs it); ``crossing[name]``: what crosses the cut
    after node ``name`` on the largest tile (default: the values whole)."""
    units = []
    tileable = None
    for index, unit in enumerate(coarse.units):
        on_tiles = [tiles[name] for name in unit.nodes if name in tiles]
        computing = [name for name in unit.nodes if name not in geometry.passive]
        if tileable is None and len(on_tiles) < len(computing):
            tileable = index
        if tileable is not None:
            units.append(unit)
            continue
        saved = sum(cost.saved_bytes for cost in on_tiles)
        first = on_tiles[0] if on_tiles else None
        bwd_ms = sum(cost.bwd_ms for cost in on_tiles)
        units.append(dataclasses.replace(
            unit, fwd_ms=sum(cost.fwd_ms for cost in on_tiles), bwd_ms=bwd_ms,
            weight_grad_ms=unit.weight_grad_ms * bwd_ms / unit.bwd_ms if unit.bwd_ms else 0.0,
            split_extra_ms=unit.split_extra_ms * bwd_ms / unit.bwd_ms if unit.bwd_ms else 0.0,
            activation_bytes=round(saved), offloadable_bytes=round(saved),
            transient_bytes=round(max((cost.transient_bytes for cost in on_tiles), default=0.0)),
            node_transient_bytes=None,  # a tile's working sets are its nodes' (no loss among them)
            input_bytes=round(min(saved, unit.input_bytes * (first.share if first else 1.0)))))
    reach = len(coarse.units) if tileable is None else tileable
    boundary = tuple(float(whole) if crossing is None or cut >= reach else crossing[coarse.units[cut].nodes[-1]]
                     for cut, whole in enumerate(coarse.boundary_bytes))
    return SpatialPart(choice, tuple(units), reach, geometry.stop, fused_groups, boundary)


@dataclass(frozen=True)
class PipelineProblem:
    """One outer configuration: partition ``units`` into the layout's parts, contiguously.

    The costs of a partition are planner/search/terms.py's terms over these numbers.
    """

    units: tuple[Unit, ...]
    boundary_bytes: tuple[int, ...]  # bytes crossing a cut after unit p (len(units) - 1 entries)
    shared: tuple[SharedParam, ...]
    layout: Layout  # which stages compute which part, on which slot
    schedule: ScheduleKind
    num_microbatches: int
    in_flight: tuple[int, ...]  # per stage: micro-batches whose activations it holds at once
    links: tuple[LinearCost, ...]  # per part but the last: p2p time across the cut after it
    allreduce: tuple[LinearCost, ...]  # per part: its gradient all-reduce, per gradient byte
    mem_bytes: int
    tiers: MemoryTiers = GPU_ONLY
    spatial: tuple[SpatialPart, ...] = ()  # the leading parts on image tiles
    balanced: BalancedStep | None = None  # a family without a closed form: its programs on balanced parts
    swapped_resident: tuple[int, ...] = ()  # per stage: micro-batches of swapped bytes on the device (() = 2)
    backend: str = "nccl"  # the device's (DeviceSpec.backend): what hides an all-reduce, which receives post early
    accumulating: tuple[int, ...] = ()  # per stage: micro-batches held when a backward adds into its gradients
    waiting: tuple[int, ...] = ()  # per stage: micro-batches whose split backward's W waits after its I, at once
    waiting_at_transient: tuple[int, ...] = ()  # of those, the most when an F or an I starts (beside the transient)

    def __post_init__(self) -> None:
        assert len(self.boundary_bytes) == len(self.units) - 1
        assert len(self.in_flight) == self.layout.num_stages
        assert len(self.links) == self.num_parts - 1 and len(self.allreduce) == self.num_parts

    @property
    def num_parts(self) -> int:
        return self.layout.num_parts


@dataclass(frozen=True)
class Coarsening:
    """Units over a graph, independent of the configuration (computed once per micro-batch)."""

    units: tuple[Unit, ...]
    boundary_bytes: tuple[int, ...]
    shared: tuple[SharedParam, ...]


def part_links(device: DeviceSpec, layout: Layout, gpus_per_node: int) -> tuple[LinearCost, ...]:
    """Per part but the last, the link its activations cross to the next part (in replica 0)."""
    def link(part: int) -> LinearCost:
        src = layout.ranks_of(layout.stages_of_part(part)[0], 0)[0]
        dst = layout.ranks_of(layout.stages_of_part(part + 1)[0], 0)[0]
        link_spec = p2p_link(device, same_node(src, dst, gpus_per_node))
        return LinearCost(*p2p_coefficients(link_spec), p2p_post_ms(link_spec))
    return tuple(link(part) for part in range(layout.num_parts - 1))


def ranks_allreduce(device: DeviceSpec, ranks: Sequence[int], gpus_per_node: int) -> LinearCost:
    """A ring all-reduce over ``ranks``."""
    return LinearCost(*ring_allreduce_coefficients(len(ranks), allreduce_link(device, ranks, gpus_per_node)))


def part_allreduces(device: DeviceSpec, layout: Layout, gpus_per_node: int) -> tuple[LinearCost, ...]:
    """Per part, a ring all-reduce over every rank holding a copy of it."""
    return tuple(ranks_allreduce(device, layout.part_ranks(part), gpus_per_node) for part in range(layout.num_parts))


def tied_sums(units: Sequence[Unit], shared: Sequence[SharedParam], part_units: Sequence[range], layout: Layout,
              device: DeviceSpec, gpus_per_node: int, part_state_bytes: Sequence[Sequence[float]]
              ) -> tuple[TiedSum, ...]:
    """The sums of tied weights' gradients a partition makes (units ``part_units[p]`` on part p): per set of parts
    using the same shared parameters, the bytes of those gradients, grouped as the runtime groups them
    (runtime/grads.py: tied_sets), each costed by :func:`tied_sum_over`; and what one copy of them holds on a
    device (``part_state_bytes``: per part, per shared parameter, its copy's state; the least of the parts')."""
    holders: dict[int, set[int]] = {}
    for part, span in enumerate(part_units):
        for unit in span:
            for q in units[unit].shared:
                holders.setdefault(q, set()).add(part)
    groups: dict[tuple[int, ...], list[int]] = {}  # parts -> the shared parameters they all use
    for q, parts in holders.items():
        if len(parts) > 1:
            groups.setdefault(tuple(sorted(parts)), []).append(q)
    return tuple(tied_sum_over(layout, parts, tuple(sorted(shared[q].name for q in indices)),
                               sum(shared[q].grad_bytes for q in indices), device, gpus_per_node,
                               round(copy_state_bytes(part_state_bytes, parts, indices)))
                 for parts, indices in sorted(groups.items()))


def copy_state_bytes(part_state_bytes: Sequence[Sequence[float]], parts: Iterable[int], indices: Iterable[int]
                     ) -> float:
    """What one copy of the shared parameters ``indices`` holds on a device, where ``parts`` all hold one and a rank
    running several keeps one tensor (runtime/stages.py: local_stages): the least of the parts' copies
    (``part_state_bytes``: per part, per shared parameter, the state its copy holds)."""
    indices = tuple(indices)
    return min(sum(part_state_bytes[part][q] for q in indices) if part_state_bytes[part] else 0.0 for part in parts)


def untied_allreduce_ms(part: int, allreduce_ms: float, ring: LinearCost, tied: Sequence[TiedSum]) -> float:
    """``part``'s data-parallel all-reduce (``allreduce_ms`` over ``ring``, its gradients' bytes all counted) less
    the tied weights' gradients: their sums carry them over every rank holding a copy, and runtime/executor.py
    leaves them out of it (the search's term counts them, not knowing which parts share a weight)."""
    tied_bytes = sum(sum_.nbytes for sum_ in tied if part in sum_.parts)
    if not (tied_bytes and allreduce_ms):
        return allreduce_ms
    return max(ring.fixed_ms, allreduce_ms - ring.ms_per_byte * tied_bytes)


def tied_sum_over(layout: Layout, parts: tuple[int, ...], names: tuple[str, ...], nbytes: int, device: DeviceSpec,
                  gpus_per_node: int, state_bytes: int) -> TiedSum:
    """The gradients of ``names`` (``nbytes``; a copy of them holding ``state_bytes``) summed over every rank
    holding a copy of one of ``parts``: a ring all-reduce over them (none where one rank holds them all: its parts
    share the one weight)."""
    ranks = layout.parts_ranks(parts)
    ms = ranks_allreduce(device, ranks, gpus_per_node).ms(nbytes) if len(ranks) > 1 else 0.0
    return TiedSum(parts, names, nbytes, ms, state_bytes)


def coarsen(graph: LayerGraph, table: CostTable, precision: Precision, optimizer: Optimizer,
            max_units: int) -> Coarsening:
    """Group nodes into at most ``max_units`` units of similar time, cutting where few bytes cross and never
    while a value that cannot cross a stage boundary lives (LayerNode.crosses: a split's tuple of tensors)."""
    crossing = _crossing_bytes(graph, table)
    times = [table[node.name].fwd_ms + table[node.name].bwd_ms for node in graph]
    cuts = _choose_cuts(times, crossing, max_units, staying_values(graph))
    return group_units(graph, table, precision, optimizer, _computing(graph, cuts))


def staying_values(graph: LayerGraph) -> list[str | None]:
    """Per node position p, a value that cannot cross a stage boundary (LayerNode.crosses) made at or before
    node p and read after it, which forbids a cut between nodes p and p + 1; None where a cut may go."""
    position = {node.name: index for index, node in enumerate(graph)}
    staying: list[str | None] = [None] * len(graph)
    for node in graph:
        readers = graph.users[node.name]
        if not node.crosses and readers:
            for index in range(position[node.name], position[readers[-1]]):
                staying[index] = node.name
    return staying


def _computing(graph: LayerGraph, cuts: list[int]) -> list[int]:
    """``cuts`` less those that would leave a unit without a node that computes (one of inputs, parameters or
    the output alone, such as the output behind a cut before it): such a unit joins the next one, or the
    last one the one before it. A part of such units alone would be a stage the runtime cannot build."""
    computes = [node.kind not in (NodeKind.INPUT, NodeKind.PARAM, NodeKind.OUTPUT) for node in graph]
    kept: list[int] = []
    start = 0
    for end in [*cuts, len(computes)]:
        if any(computes[start:end]):
            kept.append(end)
            start = end
    if start < len(computes) and kept:  # the nodes behind the last computing unit join it
        kept.pop()
    return [cut for cut in kept if cut < len(computes)]


def group_units(graph: LayerGraph, table: CostTable, precision: Precision, optimizer: Optimizer,
                cuts: list[int]) -> Coarsening:
    """Units that start at node indices ``cuts`` (plus node 0)."""
    order = [node.name for node in graph]
    crossing = _crossing_bytes(graph, table)
    groups = [order[start:end] for start, end in zip((0, *cuts), (*cuts, len(order)))]
    users = _param_users(graph, groups)
    shared_names = sorted(name for name, units in users.items() if len(units) > 1)
    shared_index = {name: index for index, name in enumerate(shared_names)}
    starts = (0, *cuts)
    used_later: list[set[str]] = [set() for _ in groups]  # per unit, its parameters a later unit uses too
    for name, holders in users.items():
        last = max(holders)
        for unit in holders - {last}:
            used_later[unit].add(name)
    whole_pass = whole_pass_params(graph)
    units = tuple(_unit(graph, table, group, precision, optimizer, shared_index, crossing[start - 1] if start else 0,
                        frozenset(used_later[position]), whole_pass)
                  for position, (group, start) in enumerate(zip(groups, starts)))
    shared = tuple(_shared_param(name, _param_state(graph, name, precision, optimizer))
                   for name in shared_names)
    return Coarsening(units, tuple(crossing[cut - 1] for cut in cuts), shared)


@dataclass(frozen=True)
class _ParamState:
    state_bytes: int
    grad_bytes: int
    weight_bytes: int
    optimizer_bytes: int
    numel: int
    tensors: int  # 1 for a parameter the optimizer steps, 0 for a buffer


def _crossing_bytes(graph: LayerGraph, table: CostTable) -> list[int]:
    """crossing[p]: bytes of activations produced at or before node p and read after it."""
    return [round(nbytes) for nbytes in crossing_bytes(graph, lambda name: table[name].output_bytes)]


def crossing_bytes(graph: LayerGraph, bytes_of: Callable[[str], float]) -> list[float]:
    """crossing[p]: the ``bytes_of`` each activation produced at or before node p and read after it."""
    position = {node.name: index for index, node in enumerate(graph)}
    delta = [0.0] * (len(graph) + 1)
    for node in graph:
        readers = graph.users[node.name]
        if node.kind is NodeKind.PARAM or not readers:
            continue
        start, end = position[node.name], position[readers[-1]]
        delta[start] += bytes_of(node.name)
        delta[end] -= bytes_of(node.name)
    crossing, running = [], 0.0
    for index in range(len(graph)):
        running += delta[index]
        crossing.append(running)
    return crossing


def _choose_cuts(times: list[float], crossing: list[int], max_units: int,
                 staying: Sequence[str | None] | None = None) -> list[int]:
    """Cut indices (a cut at c separates node c-1 from node c) for about ``max_units`` units.

    Walk the nodes accumulating time; once a unit has about total/max_units of it, cut at the
    position with the fewest crossing bytes among those that keep the unit between half and
    one and a half of the target and that no value ``staying`` spans (none there: the unit grows on).
    """
    total = sum(times) or float(len(times))
    weights = times if sum(times) > 0 else [1.0] * len(times)
    target = total / max(1, max_units)
    cuts: list[int] = []
    accumulated, index = 0.0, 0
    while index < len(weights) - 1:
        accumulated += weights[index]
        if accumulated >= target:
            window = [p for p in _window(weights, index, target) if staying is None or staying[p] is None]
            if window:
                best = min(window, key=lambda p: (crossing[p], abs(p - index)))
                cuts.append(best + 1)
                index, accumulated = best + 1, 0.0
                continue
        index += 1
    return [cut for cut in cuts if 0 < cut < len(weights)]


def _window(weights: list[float], index: int, target: float) -> range:
    """Positions around ``index`` whose unit would stay within [0.5, 1.5] x target."""
    low = index
    slack = 0.5 * target
    while low > 0 and slack - weights[low] > 0:
        slack -= weights[low]
        low -= 1
    high, extra = index, 0.0
    while high + 1 < len(weights) - 1 and extra + weights[high + 1] <= 0.5 * target:
        extra += weights[high + 1]
        high += 1
    return range(low, high + 1)


def _param_users(graph: LayerGraph, groups: list[list[str]]) -> dict[str, set[int]]:
    users: dict[str, set[int]] = {}
    for unit, names in enumerate(groups):
        for name in names:
            node = graph.node(name)
            if node.kind is not NodeKind.PARAM:
                for param in node.param_names:
                    users.setdefault(param, set()).add(unit)
    return users


def whole_pass_params(graph: LayerGraph) -> frozenset[str]:
    """Parameters a ZeRO-3 stage cannot gather layer by layer: read through get_attr, or used by a node that is
    not a module call."""
    return frozenset(p for node in graph if node.kind is not NodeKind.MODULE for p in node.param_names)


def _shared_param(name: str, state: _ParamState) -> SharedParam:
    return SharedParam(name, state.state_bytes, state.grad_bytes, state.weight_bytes, state.optimizer_bytes,
                       state.numel, state.tensors)


def _trains(graph: LayerGraph, name: str) -> bool:
    """Whether node ``name`` computes with a trainable parameter (a split backward's W then needs its output's
    gradient, which its I keeps: runtime/split_backward.py)."""
    node = graph.node(name)
    return node.kind is not NodeKind.PARAM and any(not graph.parameter(p).is_buffer for p in node.param_names)


def _param_state(graph: LayerGraph, name: str, precision: Precision, optimizer: Optimizer) -> _ParamState:
    info = graph.parameter(name)
    if info.is_buffer:
        return _ParamState(info.nbytes, 0, 0, 0, 0, 0)
    state = model_state_bytes(info.numel, precision, optimizer)
    return _ParamState(state.total_bytes, state.grad_bytes, state.param_bytes, state.optimizer_bytes, info.numel, 1)


def _unit(graph: LayerGraph, table: CostTable, names: list[str], precision: Precision,
          optimizer: Optimizer, shared_index: dict[str, int], crossing_before: int,
          used_later: frozenset[str] = frozenset(), whole_pass: frozenset[str] = frozenset()) -> Unit:
    """The unit of nodes ``names``; ``used_later``: parameters a later unit uses too; ``whole_pass``: those ZeRO-3
    cannot gather layer by layer (:func:`whole_pass_params`)."""
    params = {p for name in names if graph.node(name).kind is not NodeKind.PARAM
              for p in graph.node(name).param_names}
    own = [p for p in params if p not in shared_index]
    grads = {p: _param_state(graph, p, precision, optimizer) for p in params}  # shared ones too
    state = [grads[p] for p in own]
    uses = Counter(p for name in names if graph.node(name).kind is not NodeKind.PARAM
                   for p in dict.fromkeys(graph.node(name).param_names))
    costs = [table[name] for name in names]
    saved = sum(c.saved_activation_bytes for c in costs)
    released = sum(c.released_activation_bytes for c in costs)
    loss_kept, loss_working = loss_bytes(graph, table, names, precision)
    works = {name: node_working(graph, table, name, precision, optimizer) for name in names
             if graph.node(name).kind is not NodeKind.PARAM}
    working = {name: work.working for name, work in works.items()}
    node_transient = max(working.values(), default=0)
    transient = max(node_transient, loss_working)
    # a weight used again after its first use here has its partial gradients summed in that first user's backward
    summed = [p for p in params if uses[p] > 1 or p in used_later]
    summing = {next(name for name in working if p in graph.node(name).param_names) for p in summed}
    layered = {p: grads[p] for p in own if p not in whole_pass and not graph.parameter(p).is_buffer}
    layers = [sum(layered[p].weight_bytes for p in dict.fromkeys(graph.node(name).param_names) if p in layered)
              for name in names if graph.node(name).kind is NodeKind.MODULE]
    return Unit(
        nodes=tuple(names),
        fwd_ms=sum(c.fwd_ms for c in costs),
        bwd_ms=sum(c.bwd_ms for c in costs),
        state_bytes=sum(p.state_bytes for p in state),
        grad_bytes=sum(p.grad_bytes for p in state),
        activation_bytes=saved + loss_kept,
        transient_bytes=transient,
        node_transient_bytes=node_transient,
        summing_transient_bytes=max((working[name] for name in summing), default=0),
        shared=tuple(sorted(shared_index[p] for p in params if p in shared_index)),
        weight_bytes=sum(p.weight_bytes for p in state),
        optimizer_bytes=sum(p.optimizer_bytes for p in state),
        param_numel=sum(p.numel for p in state),
        offloadable_bytes=released,
        input_bytes=min(released, crossing_before),
        weight_grad_ms=sum(c.weight_grad_ms for c in costs),
        split_extra_ms=sum(c.split_extra_ms for c in costs),
        split_kept_bytes=sum(c.output_bytes for name, c in zip(names, costs) if _trains(graph, name)),
        weight_grad_working_bytes=max((works[name].weight_grad for name in names if _trains(graph, name)), default=0),
        param_tensors=sum(p.tensors for p in state),
        largest_param_numel=max((graph.parameter(p).numel for p in params if not graph.parameter(p).is_buffer),
                                default=0),
        largest_own_param_numel=max((graph.parameter(p).numel for p in own if not graph.parameter(p).is_buffer),
                                    default=0),
        tied_grad_bytes=sum(p.grad_bytes for name, p in zip(own, state) if uses[name] > 1),
        accumulating_bytes=max((transient, *(work.accumulating for work in works.values()))),
        layered_weight_bytes=sum(p.weight_bytes for p in layered.values()),
        layered_grad_bytes=sum(p.grad_bytes for p in layered.values()),
        layered_calls=sum(1 for nbytes in layers if nbytes),
        largest_layer_bytes=max(layers, default=0),
    )


def memory_tiers(device: DeviceSpec, space: SearchSpace, state: StateMode, *, activations: bool) -> MemoryTiers:
    """The memory costs of ``device`` for a configuration keeping model state as ``state``;
    ``activations``: whether the ILP decides recompute and swap per unit (those ``space`` allows)."""
    host_link = LinearCost(*p2p_coefficients(device.host_link))
    nvme_link = LinearCost(*p2p_coefficients(device.nvme))
    per_node = space.gpus_per_node
    device_ms_per_byte = 1e3 / (device.mem_bandwidth_gb_per_s * BYTES_PER_GB * device.memory_efficiency)
    return MemoryTiers(
        recompute=activations and Offload.RECOMPUTE in space.offload,
        swap=activations and Offload.SWAP in space.offload, state=state, host_link=host_link, nvme_link=nvme_link,
        host_step_ms_per_param=1e3 / device.host_optimizer_params_per_s,
        host_sum_ms_per_param=1e3 / device.grad_sum_params_per_s(),
        device_step_ms_per_byte=device_ms_per_byte,
        device_step=device.optimizer_step(space.optimizer.value),
        # on the cpu device the host is the device: its optimizer step is the one measured there, per tensor too
        host_step=device.optimizer_step(space.optimizer.value) if device.name == CPU_NAME else None,
        host_grad_bytes_per_param=space.precision.state_itemsize,
        host_master_bytes_per_param=0 if space.precision.master_weights else space.precision.state_itemsize,
        host_mem_bytes=space.host_mem_bytes if space.host_mem_bytes is not None else device.host_mem_bytes * per_node,
        nvme_bytes=space.nvme_bytes if space.nvme_bytes is not None else device.nvme_bytes * per_node,
        gpus_per_node=per_node, precision=space.precision, optimizer=space.optimizer)
