"""What a plan must satisfy beyond its fields' types: counts, the batch arithmetic, sizes that agree.

Checked when a plan file is decoded (Plan.from_dict) and by the runtime before any work
(runtime/checks.py), so a hand-edited or corrupt plan is refused naming the field, never run.
Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from cost_models.errors import PlanFileError
from planner.plan.spatial import HaloMode, SpatialSpec

if TYPE_CHECKING:
    from planner.plan.document import Plan


def check_invariants(plan: Plan) -> None:
    """Raise PlanFileError naming the first field that breaks an invariant, and the fix."""
    for check in _CHECKS:
        for problem in check(plan):
            raise PlanFileError(f"plan field {problem}; re-create the plan with `tessera plan`")


def _positive_counts(plan: Plan) -> Iterator[str]:
    counts = {"cluster.gpus": plan.cluster.gpus, "cluster.gpus_per_node": plan.cluster.gpus_per_node,
              "cluster.mem_bytes": plan.cluster.mem_bytes,
              "training.global_batch_size": plan.training.global_batch_size,
              "training.micro_batch_size": plan.training.micro_batch_size,
              "training.num_microbatches": plan.training.num_microbatches}
    counts.update({f"schedule.in_flight[{stage}]": held
                   for stage, held in enumerate(plan.schedule.in_flight)})
    yield from (f"{path} is {value}; it must be >= 1" for path, value in counts.items() if value < 1)


def _budget(plan: Plan) -> Iterator[str]:
    cluster = plan.cluster
    if not 0 <= cluster.reserve_bytes < cluster.mem_bytes:
        yield (f"cluster.reserve_bytes is {cluster.reserve_bytes}; it must be >= 0 and below "
               f"cluster.mem_bytes ({cluster.mem_bytes})")
    if cluster.gpus_available is not None and cluster.gpus_available < cluster.gpus:
        yield (f"cluster.gpus_available is {cluster.gpus_available}; it must be at least the "
               f"cluster.gpus the plan uses ({cluster.gpus})")


def _batch(plan: Plan) -> Iterator[str]:
    training = plan.training
    total = training.micro_batch_size * training.num_microbatches * plan.data_parallel
    if total != training.global_batch_size:
        yield (f"training.global_batch_size is {training.global_batch_size}, but micro_batch_size "
               f"{training.micro_batch_size} x num_microbatches {training.num_microbatches} x the "
               f"layout's {plan.data_parallel} data-parallel replicas = {total}")


def _sizes(plan: Plan) -> Iterator[str]:
    layout = plan.layout
    if plan.cluster.gpus != layout.world_size:
        yield f"cluster.gpus is {plan.cluster.gpus} but the layout places {layout.world_size} ranks"
    if len(plan.programs) != layout.world_size:
        yield (f"programs has {len(plan.programs)} rank programs but the layout places "
               f"{layout.world_size} ranks")
    if len(plan.stages) != layout.num_parts:
        yield f"stages has {len(plan.stages)} parts but the layout has {layout.num_parts}"
    if len(plan.schedule.in_flight) != layout.num_stages:
        yield (f"schedule.in_flight has {len(plan.schedule.in_flight)} entries but the layout has "
               f"{layout.num_stages} stages")


def _stages(plan: Plan) -> Iterator[str]:
    seen: dict[str, int] = {}
    for position, stage in enumerate(plan.stages):
        if stage.index != position:
            yield f"stages[{position}].index is {stage.index}; it must equal its position {position}"
        if not stage.nodes:
            yield f"stages[{position}].nodes is empty; every part computes at least one node"
        for name in stage.nodes:
            if seen.setdefault(name, position) != position:
                yield f"stages[{position}].nodes repeats node {name!r} of stages[{seen[name]}]"


def _transfers(plan: Plan) -> Iterator[str]:
    stages = plan.layout.num_stages
    for index, transfer in enumerate(plan.transfers):
        ends = (transfer.src_stage, transfer.dst_stage)
        if ends[0] == ends[1] or not all(0 <= stage < stages for stage in ends):
            yield (f"transfers[{index}] goes from stage {ends[0]} to {ends[1]}; it must join two "
                   f"different stages of 0..{stages - 1}")


def _tied_sums(plan: Plan) -> Iterator[str]:
    parts = plan.layout.num_parts
    for index, tied in enumerate(plan.tied_sums):
        if tied.nbytes < 0 or tied.ms < 0 or tied.state_bytes < 0:
            yield (f"tied_sums[{index}] sums {tied.nbytes} bytes in {tied.ms} ms, a copy holding {tied.state_bytes} "
                   f"bytes; none may be negative")
        if len(tied.parts) < 2 or list(tied.parts) != sorted(set(tied.parts)) \
                or not all(0 <= part < parts for part in tied.parts):
            yield (f"tied_sums[{index}].parts is {list(tied.parts)}; it must list two or more different parts of "
                   f"0..{parts - 1} in order")


def _offload(plan: Plan) -> Iterator[str]:
    """ZeRO stages 0-3; gradients on the host only beside a step there; gather groups only under ZeRO-3, each
    parameter in one; checkpoint regions are runs of consecutive stage nodes, disjoint from each other and from
    swaps."""
    for position, stage in enumerate(plan.stages):
        path, offload = f"stages[{position}].offload", stage.offload
        order = {name: index for index, name in enumerate(stage.nodes)}
        if not 0 <= offload.zero_stage <= 3:
            yield f"{path}.zero_stage is {offload.zero_stage}; it must be 0, 1, 2 or 3"
        if offload.grads_on_host and not offload.host_step:
            yield (f"{path}.grads_on_host is true but its optimizer_state is {offload.optimizer_state.value}; "
                   f"gradients on the host need the step on the host (optimizer_state host or nvme)")
        if offload.prefetch and offload.zero_stage != 3:
            yield (f"{path}.prefetch is true but zero_stage is {offload.zero_stage}; only ZeRO-3 gathers parameters "
                   f"ahead (zero_stage 3), or set prefetch false")
        if offload.gathers and offload.zero_stage != 3:
            yield (f"{path}.gathers lists {len(offload.gathers)} gather groups but zero_stage is "
                   f"{offload.zero_stage}; only ZeRO-3 gathers parameters (zero_stage 3), or leave gathers empty")
        gathered = [param for group in offload.gathers for param in group]
        if any(not group for group in offload.gathers) or len(set(gathered)) != len(gathered):
            yield (f"{path}.gathers has an empty group or names a parameter twice "
                   f"({sorted({p for p in gathered if gathered.count(p) > 1})}); each parameter is in one group")
        named = [node for region in offload.recompute for node in region] + list(offload.swap)
        strangers = sorted({node for node in named if node not in order})
        if strangers:
            yield f"{path} names nodes {strangers} that stage {position} does not compute"
            continue
        twice = sorted({node for node in named if named.count(node) > 1})
        if twice:
            yield f"{path} names nodes {twice} more than once (each is kept, recomputed or swapped)"
        for index, region in enumerate(offload.recompute):
            places = [order[node] for node in region]
            if not region or places != list(range(places[0], places[0] + len(region))):
                yield (f"{path}.recompute[{index}] is not a run of consecutive nodes of the stage "
                       f"in their order")


def _spatial(plan: Plan) -> Iterator[str]:
    """A spatial part runs on as many ranks per slot as it has tiles, on a grid its image can fill;
    every other part on one rank per slot."""
    layout = plan.layout
    for part, stage in enumerate(plan.stages):
        path, spec = f"stages[{part}].spatial", stage.spatial
        ranks = {len(layout.ranks_of(s, 0)) for s in layout.stages_of_part(part)} if part < layout.num_parts else {1}
        if spec is None:
            if ranks != {1}:
                yield (f"{path} is null but the layout runs part {part} on {sorted(ranks)} ranks per slot; "
                       f"give it a spatial section or one rank per slot")
            continue
        yield from _spatial_spec(path, spec, ranks, stage.nodes)


def _spatial_spec(path: str, spec: SpatialSpec, ranks: set[int], nodes: tuple[str, ...]) -> Iterator[str]:
    rows, cols = spec.grid_shape
    if spec.parts < 2:
        yield f"{path}.parts is {spec.parts}; a spatial stage needs at least 2 tiles (or spatial null)"
    elif ranks != {spec.parts}:
        yield (f"{path}.parts is {spec.parts} but the layout runs the part on {sorted(ranks)} ranks per slot; "
               f"they must be equal")
    elif not rows:
        yield (f"{path}.parts is {spec.parts}, which square slicing cannot cut (it needs a square number "
               f"such as 4 or 9); use vertical or horizontal slicing")
    elif spec.height < rows or spec.width < cols:
        yield (f"{path} image {spec.height}x{spec.width} cannot be cut into {rows}x{cols} tiles of at "
               f"least one pixel; use fewer tiles or another slicing")
    if spec.halo_bytes and (len(spec.halo_bytes) != spec.parts or min(spec.halo_bytes) < 0):
        yield (f"{path}.halo_bytes has {len(spec.halo_bytes)} entries {list(spec.halo_bytes)[:4]}; give one "
               f"count >= 0 per tile ({spec.parts}) or none")
    if spec.fused_groups and spec.halo is not HaloMode.FUSED:
        yield f"{path}.fused_groups is given but halo is {spec.halo.value!r}; groups need halo 'fused'"
    named = [node for group in spec.fused_groups for node in group]
    strangers = sorted({node for node in named if node not in nodes} | {n for n in named if named.count(n) > 1})
    if strangers or any(not group for group in spec.fused_groups):
        yield (f"{path}.fused_groups names nodes {strangers} that are not the stage's or repeats them "
               f"(or has an empty group); give runs of the stage's own nodes, each once")


_CHECKS: tuple[Callable[[Plan], Iterator[str]], ...] = (_positive_counts, _budget, _batch, _sizes, _stages,
                                                       _transfers, _tied_sums, _offload, _spatial)
