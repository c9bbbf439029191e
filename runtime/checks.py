"""Set-up checks made before any work: world size, the plan's layout and programs, what this runtime runs.

``check_plan`` (planner/preflight.py, which `tessera run` also makes before launching) accepts
every plan whose layout and programs are consistent (spatial tiles and ranks holding several
stages included: the validator replays every rank's program, so a corrupt plan is refused instead
of hanging). ``check_executable`` then refuses, with the reason, what this runtime does not
execute yet.
"""

from __future__ import annotations

from cost_models.errors import RuntimeSetupError
from planner.plan import OffloadSpec, ParamTier, Plan
from planner.preflight import check_plan, programs
from planner.schedules import Action, ActionKind, Program

__all__ = ["SUPPORTED", "check_executable", "check_plan", "check_world_size", "my_stages", "rank_program",
           "segments"]

SUPPORTED = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.SEND_F, ActionKind.RECV_F,
                       ActionKind.SEND_B, ActionKind.RECV_B, ActionKind.ALLREDUCE,
                       ActionKind.OPTIMIZER_STEP, ActionKind.SWAP_OUT, ActionKind.SWAP_IN})


def check_world_size(plan: Plan, world_size: int) -> None:
    if world_size != plan.layout.world_size:
        raise RuntimeSetupError(
            f"the plan is for {plan.layout.world_size} processes ({plan.layout.describe()}) but {world_size} "
            f"were launched; run `torchrun --nproc-per-node {plan.layout.world_size} -m runtime PLAN` (or "
            f"`tessera run PLAN`), or re-plan for {world_size} GPUs")


def check_executable(plan: Plan) -> None:
    """Refuse what this runtime does not execute yet (each names the planner option that avoids it)."""
    layout = plan.layout
    for rank in range(layout.world_size):
        parts = [layout.part(stage) for stage in layout.stages_of_rank(rank)]
        twice = sorted({part for part in parts if parts.count(part) > 1})
        if twice:
            raise RuntimeSetupError(f"rank {rank} runs parts {twice} for two model copies (stage to part map "
                                    f"{list(layout.stage_part)}), which this runtime does not execute yet; "
                                    f"re-plan gems-master with an even number of parts")
    if layout.num_copies > 1 and any(stage.spatial is not None for stage in plan.stages):
        raise RuntimeSetupError(f"the plan runs {layout.num_copies} model copies with spatial stages, which this "
                                f"runtime does not execute together yet; re-plan without spatial stages")
    split = any(action.kind is ActionKind.W for program in programs(plan) for action in program)
    _check_stale(plan)
    for stage in plan.stages:
        _check_offload(stage.index, stage.offload)
        copies = len(layout.part_ranks(stage.index))
        if stage.offload.params is ParamTier.HOST and copies == 1:
            raise RuntimeSetupError(f"stage {stage.index} keeps its parameters on the host as ZeRO-3 shards but runs "
                                    f"on one rank, which holds no shard of another; re-plan it with its parameters "
                                    f"on the GPU or with data-parallel replicas")
        if stage.offload.grads_on_host and copies > 1:
            raise RuntimeSetupError(f"stage {stage.index} sends its gradients to the host each backward and runs on "
                                    f"{copies} ranks (replicas, mirror copies or tiles), whose gradients this runtime "
                                    f"sums on the device; re-plan it with its gradients on the GPU or on one rank")
        if layout.num_copies > 1 and stage.offload.zero_stage == 3:
            raise RuntimeSetupError(f"stage {stage.index} shards its parameters (ZeRO-3) over {copies} ranks that run "
                                    f"it for {layout.num_copies} model copies in opposite directions (GEMS-MASTER), "
                                    f"whose layer gathers would wait for each other at different points of the "
                                    f"schedule; re-plan with ZeRO 0-2 there or another schedule")
        if split and stage.offload.zero_stage == 3:
            raise RuntimeSetupError(f"stage {stage.index} shards its parameters (ZeRO-3) and the schedule splits "
                                    f"backwards into I and W, which this runtime does not execute together yet; "
                                    f"re-plan with ZeRO 0-2 there or another schedule")
        if stage.spatial is not None:
            _check_spatial(plan, stage.index)


def _check_stale(plan: Plan) -> None:
    """Stages on stashed weight versions (WPipe's first group, runtime/stale.py) keep their model state whole
    on the GPU (in 16 bits beside fp32 masters under mixed precision: the stashed versions are 16-bit copies),
    and recompute as their only memory decision."""
    kind = plan.schedule.kind
    stale = kind.stale_parts(plan.layout.num_parts)
    for stage in plan.stages:
        if stage.index in stale and stage.offload != OffloadSpec(recompute=stage.offload.recompute):
            raise RuntimeSetupError(f"stage {stage.index} of the {kind.value} plan stashes weight versions and also "
                                    f"{stage.offload.describe(len(stage.nodes))}, which this runtime does not "
                                    f"execute together yet; re-plan it (the search keeps such stages on the GPU)")


def _check_spatial(plan: Plan, stage: int) -> None:
    """This runtime executes spatial stages as the leading stages 0..k-1, each on its own slot,
    followed by ordinary stages, in any precision, with every memory decision an ordinary stage may take (its
    tiles are copies of its model state, as replicas are: ZeRO shards it over them), with per-layer halos or
    fused groups (runtime/spatial_stage.py checks those against the stage's graph)."""
    assert plan.stages[stage].spatial is not None
    _check_leading(plan, stage)


def _check_leading(plan: Plan, stage: int) -> None:
    """Spatial stage ``stage`` is one of the leading stages 0..k-1, on a slot of its own, and an ordinary
    stage follows them (it joins the last tiles)."""
    layout = plan.layout
    ordinary = [part.index for part in plan.stages[:stage] if part.spatial is None]
    if ordinary:
        raise RuntimeSetupError(f"stage {stage} runs on spatial tiles after stage {ordinary[0]}, which does not; "
                                f"this runtime executes spatial stages only as the leading stages 0..k-1; "
                                f"re-plan with the spatial stages first")
    sharing = layout.stages_on_slot(layout.slot(stage))
    if len(sharing) != 1:
        raise RuntimeSetupError(f"stage {stage} runs on spatial tiles but shares slot {layout.slot(stage)} with "
                                f"stages {[s for s in sharing if s != stage]}, which this runtime does not "
                                f"execute yet; re-plan with each spatial stage on a slot of its own")
    if plan.stages[-1].spatial is not None:
        raise RuntimeSetupError(f"stage {stage} runs on spatial tiles and so does every later stage up to the "
                                f"last ({plan.num_stages - 1}); this runtime needs an ordinary stage after the "
                                f"spatial ones to join their tiles; re-plan with a non-spatial last stage")


def _check_offload(stage: int, offload: OffloadSpec) -> None:
    """This runtime executes recomputation, activation swapping, ZeRO 0-3 and the optimizer state on
    the GPU, host or NVMe (any mix, in every precision), and with ZeRO-3 and the optimizer off the GPU the
    parameters' shards on the host (ZeRO-Infinity's parameter offload: each layer's gather copies them up)."""
    if offload.params is not ParamTier.GPU and not (offload.zero_stage == 3 and offload.host_step):
        raise RuntimeSetupError(f"stage {stage} keeps its parameters on the {offload.params.value} with ZeRO stage "
                                f"{offload.zero_stage} and the optimizer on the {offload.optimizer_state.value}; "
                                f"this runtime keeps parameters on the host only as ZeRO-3 shards stepped off the "
                                f"GPU: re-plan stage {stage} with ZeRO-3 and the optimizer on the host or NVMe, "
                                f"or its parameters on the GPU")
    if not 0 <= offload.zero_stage <= 3:
        raise RuntimeSetupError(f"stage {stage} asks for ZeRO stage {offload.zero_stage}; the runtime runs "
                                f"ZeRO stages 0 to 3, re-plan with one of those")


def rank_program(plan: Plan, rank: int) -> Program:
    """This rank's parsed program; rejects actions the runtime cannot run yet."""
    program = programs(plan)[rank]
    unsupported = sorted({action.kind.value for action in program if action.kind not in SUPPORTED})
    if unsupported:
        raise RuntimeSetupError(f"rank {rank}'s program uses {unsupported}, which this runtime does "
                                f"not execute yet (offload); re-plan without offload")
    return program


def my_stages(plan: Plan, rank: int) -> tuple[tuple[int, ...], int]:
    """The stages ``rank`` runs and its data-parallel replica."""
    return plan.layout.stages_of_rank(rank), plan.layout.place(rank).replica


def segments(program: Program) -> list[Action | tuple[Action, ...]]:
    """The program with runs of consecutive sends/receives grouped (one batch each)."""
    grouped: list[Action | tuple[Action, ...]] = []
    run: list[Action] = []
    for action in program:
        if action.kind.is_communication:
            run.append(action)
            continue
        if run:
            grouped.append(tuple(run))
            run = []
        grouped.append(action)
    if run:
        grouped.append(tuple(run))
    return grouped
