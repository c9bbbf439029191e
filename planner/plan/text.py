"""What `print(plan)` and `tessera show` display: one row per stage, then the step and the why.

It reads the plan's parts, not the Plan itself, so the plan file module can use it without a loop.
"""

from __future__ import annotations

from cost_models.units import format_bytes, format_ms, plural
from planner.plan.layout import Layout
from planner.plan.parts import (
    ClusterSpec,
    ModelRef,
    Prediction,
    ScheduleSpec,
    SolverReport,
    StagePlan,
    TiedSum,
    TrainingSpec,
)

_COLUMNS = ("stage", "ranks", "first node", "last node", "nodes", "params", "fwd", "bwd",
            "activations", "peak mem")


def format_plan(model: ModelRef, cluster: ClusterSpec, training: TrainingSpec, schedule: ScheduleSpec,
                layout: Layout, parts: tuple[StagePlan, ...], predicted: Prediction,
                solver: SolverReport, tied_sums: tuple[TiedSum, ...]) -> str:
    rows = [_COLUMNS] + [_stage_row(stage, layout, parts, schedule, predicted, cluster.usable_mem_bytes)
                         for stage in range(layout.num_stages)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [_title(model, cluster, training, schedule, layout)]
    for index, row in enumerate(rows):
        cells = [cell.ljust(w) if i < 4 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("-" * len(lines[-1]))
    lines.append("-" * len(lines[1]))
    lines.extend(_spatial(parts, layout))
    lines.extend(_stale(schedule, layout))
    lines.extend(_memory_decisions(cluster, parts, layout))
    lines.extend(_tied(tied_sums, layout))
    lines.extend(_summary(predicted, solver, cluster.usable_mem_bytes, layout.num_stages))
    return "\n".join(lines)


def _spatial(parts: tuple[StagePlan, ...], layout: Layout) -> list[str]:
    """Per spatial stage, e.g. "stage 0: 4 tiles (square), per-layer halos, ranks 0-3"."""
    return [f"stage {stage}: {parts[layout.part(stage)].spatial.describe()}, ranks "  # type: ignore[union-attr]
            f"{layout.describe_ranks(stage)}" for stage in range(layout.num_stages)
            if parts[layout.part(stage)].spatial is not None]


def _stale(schedule: ScheduleSpec, layout: Layout) -> list[str]:
    """What a schedule that trains on stale weights changes (WPipe), said where the user reads the plan."""
    stale = schedule.kind.stale_parts(layout.num_parts)
    if not stale:
        return []
    stages = [stage for stage in range(layout.num_stages) if layout.part(stage) in stale]
    return [f"stale weights ({schedule.kind.value}, allowed by allow_stale_weights): stages {stages[0]}-{stages[-1]} "
            f"compute each step on their weights from before the previous update (one update late); "
            f"stages {stages[-1] + 1}-{layout.num_stages - 1} update as usual"]


def _tied(tied_sums: tuple[TiedSum, ...], layout: Layout) -> list[str]:
    """Per weight tied across parts, where its gradient is summed, e.g. "tied: wte.weight summed over stages 0 and 3
    (ranks 0, 1) before each step: 1.0 MiB, 2.1 ms"."""
    lines = []
    for tied in tied_sums:
        stages = [stage for stage in range(layout.num_stages) if layout.part(stage) in tied.parts]
        ranks = layout.parts_ranks(tied.parts)
        span = (f"{ranks[0]}-{ranks[-1]}" if ranks == tuple(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2
                else ", ".join(map(str, ranks)))
        listed = f"{', '.join(map(str, stages[:-1]))} and {stages[-1]}"
        where = (f" summed over stages {listed} (ranks {span}) before each step: {format_bytes(tied.nbytes)}, "
                 f"{format_ms(tied.ms)}" if len(ranks) > 1 else f", one tensor on rank {ranks[0]} for stages {listed}: "
                                                                 f"no sum")
        lines.append(f"tied: {', '.join(tied.names)}{where}")
    return lines


def _memory_decisions(cluster: ClusterSpec, parts: tuple[StagePlan, ...], layout: Layout) -> list[str]:
    """Per stage, what it recomputes, swaps and keeps off the GPU; then the host and NVMe it uses."""
    lines: list[str] = []
    runs: list[tuple[int, int, str]] = []  # (first stage, last stage, decisions) of consecutive stages alike
    for stage in parts:
        said = stage.offload.describe(len(stage.nodes))
        if runs and runs[-1][2] == said and runs[-1][1] == stage.index - 1:
            runs[-1] = (runs[-1][0], stage.index, said)
        else:
            runs.append((stage.index, stage.index, said))
    for first, last, said in runs:
        if said:
            lines.append(f"stage {first}: {said}" if first == last else f"stages {first}-{last}: {said}")
    if cluster.host_mem_bytes is None:
        return lines
    ranks = [sum(len(layout.ranks_of(stage, replica)) for replica in range(layout.data_parallel))
             for stage in range(layout.num_stages)]
    host = sum(count * parts[layout.part(stage)].predicted.host_bytes for stage, count in enumerate(ranks))
    nvme = sum(count * parts[layout.part(stage)].predicted.nvme_bytes for stage, count in enumerate(ranks))
    nodes = -(-cluster.gpus // cluster.gpus_per_node)
    lines.append(f"host: optimizer state and gradients {format_bytes(host)} over {plural(nodes, 'node')} "
                 f"({format_bytes(cluster.host_mem_bytes)} host memory per node); NVMe {format_bytes(nvme)} "
                 f"({format_bytes(cluster.nvme_bytes or 0)} per node)")
    return lines


def _title(model: ModelRef, cluster: ClusterSpec, training: TrainingSpec, schedule: ScheduleSpec,
           layout: Layout) -> str:
    return (f"plan: {layout.describe()} on "
            f"{_gpus(cluster)} x {cluster.device_name} ({_budget(cluster)}), "
            f"{schedule.kind.value}, batch {training.global_batch_size} = "
            f"{plural(layout.data_parallel, 'replica')} x "
            f"{plural(training.num_microbatches, 'micro-batch', 'micro-batches')} x "
            f"{plural(training.micro_batch_size, 'sample')}, {model.precision.value}")


def _gpus(cluster: ClusterSpec) -> str:
    available = cluster.gpus_available
    return f"{cluster.gpus} of {available}" if available and available != cluster.gpus else str(cluster.gpus)


def _budget(cluster: ClusterSpec) -> str:
    if not cluster.reserve_bytes:
        return f"{format_bytes(cluster.mem_bytes)} budget each"
    return (f"{format_bytes(cluster.mem_bytes)} budget each less {format_bytes(cluster.reserve_bytes)} "
            f"reserved: {format_bytes(cluster.usable_mem_bytes)} usable")


def _stage_row(stage: int, layout: Layout, parts: tuple[StagePlan, ...], schedule: ScheduleSpec,
               predicted: Prediction, budget: int) -> tuple[str, ...]:
    part = parts[layout.part(stage)]
    cost = part.predicted
    peak = predicted.peak_mem_bytes[layout.ranks_of(stage, 0)[0]]
    return (str(stage), layout.describe_ranks(stage), part.nodes[0], part.nodes[-1], str(len(part.nodes)),
            format_bytes(cost.param_bytes), format_ms(cost.fwd_ms), format_ms(cost.bwd_ms),
            format_bytes(schedule.in_flight[stage] * cost.activation_bytes),
            f"{format_bytes(peak)} ({peak / budget:.0%})")


def _status(solver: SolverReport) -> str:
    """The winner's ILP status, and whether the plan is proven the best (the why-line says why not)."""
    if solver.proven_optimal:
        return solver.status
    if solver.status == "optimal" and solver.decisions_local and not solver.configs_unexamined:
        return "optimal within a window of cuts (NOT PROVEN OPTIMAL)"
    return f"{solver.status} (NOT PROVEN OPTIMAL)"


def _summary(predicted: Prediction, solver: SolverReport, budget: int, num_stages: int) -> list[str]:
    lines = [
        f"step: {format_ms(predicted.step_ms)}   samples/s: {predicted.samples_per_s:.1f}   "
        f"{idle_label(num_stages)}: {predicted.bubble_fraction:.1%}   peak memory: "
        f"{_peak(max(predicted.peak_mem_bytes), budget)}",
        f"solver: {solver.name} {_status(solver)} "
        f"in {solver.wall_s:.2f} s, {plural(solver.configs_tried, 'configuration')} considered; "
        f"ILP objective {format_ms(solver.objective)} (ranks configurations; the step above is simulated)",
        f"why: {solver.why}",
    ]
    if solver.binding:
        lines.append(f"binding: {solver.binding}")
    return lines


def idle_label(num_stages: int) -> str:
    """What the idle share of a step is: a pipeline's bubble, or with one stage the gradient all-reduce."""
    return "bubble" if num_stages > 1 else "idle in all-reduce"


def _peak(peak_bytes: int, budget: int) -> str:
    return (f"{format_bytes(peak_bytes)} of {format_bytes(budget)} usable ({peak_bytes / budget:.0%}, "
            f"{format_bytes(budget - peak_bytes)} headroom)")
