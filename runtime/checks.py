"""Set-up checks made before any work: world size, plan layout, and the actions this runtime runs."""

from __future__ import annotations

from cost_models.errors import RuntimeSetupError
from planner.plan import SCHEMA_VERSION, Plan
from planner.schedules import Action, ActionKind, Program, parse_programs

SUPPORTED = frozenset({ActionKind.F, ActionKind.B, ActionKind.SEND_F, ActionKind.RECV_F,
                       ActionKind.SEND_B, ActionKind.RECV_B, ActionKind.ALLREDUCE,
                       ActionKind.OPTIMIZER_STEP})


def check_world_size(plan: Plan, world_size: int) -> None:
    if world_size != plan.cluster.gpus:
        raise RuntimeSetupError(
            f"the plan is for {plan.cluster.gpus} processes ({plan.num_stages} stages x "
            f"{plan.data_parallel} data-parallel replicas) but {world_size} were launched; run "
            f"`torchrun --nproc-per-node {plan.cluster.gpus} -m runtime PLAN` (or `tessera run "
            f"PLAN`), or re-plan for {world_size} GPUs")


def check_layout(plan: Plan) -> None:
    """Schema version, one program per rank, every rank used, and the batch arithmetic."""
    if plan.schema_version != SCHEMA_VERSION:
        raise RuntimeSetupError(f"plan schema_version is {plan.schema_version} but this runtime runs "
                                f"version {SCHEMA_VERSION}; re-create the plan with `tessera plan`")
    if len(plan.programs) != plan.cluster.gpus:
        raise RuntimeSetupError(f"the plan has {len(plan.programs)} rank programs for "
                                f"{plan.cluster.gpus} GPUs; re-create it with `tessera plan`")
    ranks = {rank for stage in plan.stages for rank in stage.ranks}
    if ranks != set(range(plan.cluster.gpus)) or any(
            len(stage.ranks) != plan.data_parallel for stage in plan.stages):
        raise RuntimeSetupError(f"the plan's stages hold ranks {[list(s.ranks) for s in plan.stages]}; "
                                f"every rank 0..{plan.cluster.gpus - 1} must run a stage and every "
                                f"stage needs {plan.data_parallel} replicas")
    total = plan.training.micro_batch_size * plan.training.num_microbatches * plan.data_parallel
    if total != plan.training.global_batch_size:
        raise RuntimeSetupError(f"micro-batch size {plan.training.micro_batch_size} x "
                                f"{plan.training.num_microbatches} micro-batches x {plan.data_parallel} "
                                f"replicas = {total}, not the global batch {plan.training.global_batch_size}")


def rank_program(plan: Plan, rank: int) -> Program:
    """This rank's parsed program; rejects actions the runtime cannot run yet."""
    try:
        program = parse_programs([plan.programs[rank]])[0]
    except ValueError as error:
        raise RuntimeSetupError(f"rank {rank}'s program in the plan is malformed: {error}") from None
    unsupported = sorted({action.kind.value for action in program if action.kind not in SUPPORTED})
    if unsupported:
        raise RuntimeSetupError(f"rank {rank}'s program uses {unsupported}, which this runtime does "
                                f"not execute yet (offload); re-plan without offload")
    return program


def my_stages(plan: Plan, rank: int) -> tuple[tuple[int, ...], int]:
    """The stages ``rank`` runs and its replica index (its position in those stages' rank lists)."""
    stages = tuple(stage.index for stage in plan.stages if rank in stage.ranks)
    replicas = {plan.stages[stage].ranks.index(rank) for stage in stages}
    if len(replicas) != 1:
        raise RuntimeSetupError(f"rank {rank} runs stages {list(stages)} in replicas {sorted(replicas)}; "
                                f"a rank must belong to exactly one pipeline replica")
    return stages, replicas.pop()


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
