"""What `print(plan)` and `tessera show` display: one row per stage, then the step and the why."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cost_models.units import format_bytes, format_ms

if TYPE_CHECKING:
    from planner.plan.document import Plan

_COLUMNS = ("stage", "ranks", "first node", "last node", "nodes", "params", "fwd", "bwd",
            "activations", "peak mem")

def format_plan(plan: "Plan") -> str:
    budget = plan.cluster.mem_bytes
    rows = [_COLUMNS] + [_stage_row(plan, stage) for stage in plan.stages]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [_title(plan)]
    for index, row in enumerate(rows):
        cells = [cell.ljust(w) if i < 4 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("-" * len(lines[-1]))
    lines.append("-" * len(lines[1]))
    lines.extend(_summary(plan, budget))
    return "\n".join(lines)

def _title(plan: "Plan") -> str:
    cluster, training = plan.cluster, plan.training
    return (f"plan: {plan.num_stages} stages x {plan.data_parallel} data-parallel on "
            f"{cluster.gpus} x {cluster.device_name} ({format_bytes(cluster.mem_bytes)} budget each), "
            f"{plan.schedule.kind.value}, batch {training.global_batch_size} = "
            f"{plan.data_parallel} x {training.num_microbatches} x {training.micro_batch_size}")

def _stage_row(plan: "Plan", stage) -> tuple[str, ...]:
    param_bytes = stage.predicted.param_bytes
    ranks = ",".join(str(r) for r in stage.ranks) if len(stage.ranks) <= 4 else (
        f"{stage.ranks[0]}..{stage.ranks[-1]}")
    peak = stage.predicted.peak_mem_bytes
    share = f" ({peak / plan.cluster.mem_bytes:.0%})"
    return (str(stage.index), ranks, stage.nodes[0], stage.nodes[-1], str(len(stage.nodes)),
            format_bytes(param_bytes), format_ms(stage.predicted.fwd_ms), format_ms(stage.predicted.bwd_ms),
            format_bytes(stage.predicted.activation_bytes), format_bytes(peak) + share)

def _summary(plan: "Plan", budget: int) -> list[str]:
    predicted, solver = plan.predicted, plan.solver
    lines = [
        f"step: {format_ms(predicted.step_ms)}   samples/s: {predicted.samples_per_s:.1f}   "
        f"bubble: {predicted.bubble_fraction:.1%}   peak memory: "
        f"{format_bytes(max(predicted.peak_mem_bytes))} of {format_bytes(budget)}",
        f"solver: {solver.name} {solver.status} in {solver.wall_s:.2f} s, "
        f"{solver.configs_tried} configurations considered; objective {format_ms(solver.objective)}",
        f"why: {solver.why}",
    ]
    if solver.binding:
        lines.append(f"binding: {solver.binding}")
    return lines
