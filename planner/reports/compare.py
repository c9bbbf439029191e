"""``tessera validate``: a plan's predictions beside what a run measured, per rank, with a verdict.

Compared, where the run report measures them: the step time (of the job: the slowest rank's;
per rank: its own), samples/s, the bubble (of the job, and per rank its idle share, against the
simulator's replay of the plan; measured on CPU, where the runtime times its compute actions; and
the job's against a replay on the compute times the run measured, which isolates the schedule),
each rank's peak memory, the halo bytes each rank's spatial exchanges sent, and the bytes its pipeline
sends posted (the plan's transfers: a gradient as large as its value, so an integer value crossing a
cut, which carries no gradient back, shows as fewer bytes measured; not compared in plans with
spatial stages, whose tiles send pieces of values). Every error is ``(measured -
predicted) / predicted`` in percent, a share's (the bubble's) ``measured - predicted`` in
percentage points; the line with the largest magnitude is marked, and ``verdict`` names it when
it is above a tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cost_models.errors import PlanFileError
from cost_models.units import format_bytes, format_ms
from planner.plan import Plan
from planner.reports.run_report import RunReport
from planner.schedules.actions import ActionKind, parse_programs
from planner.simulation import simulate_measured, simulate_plan

WORST_MARK = "<- worst"


@dataclass(frozen=True)
class Check:
    """One quantity the plan predicts and the run measured (``rank`` None: the whole job)."""

    metric: str
    rank: int | None
    predicted: float
    measured: float
    show: Callable[[float], str]
    points: bool = False  # a share: the error is measured - predicted, in percentage points

    @property
    def label(self) -> str:
        return self.metric if self.rank is None else f"rank {self.rank} {self.metric}"

    @property
    def error_pct(self) -> float:
        """``(measured - predicted) / predicted`` in percent (a share's difference in percentage
        points); infinite when only the prediction is 0."""
        if self.points:
            return (self.measured - self.predicted) * 100
        if not self.predicted:
            return 0.0 if not self.measured else float("inf")
        return (self.measured - self.predicted) / self.predicted * 100


def checks(plan: Plan, report: RunReport) -> tuple[Check, ...]:
    """Every prediction of ``plan`` that ``report`` measured, the job's first, then rank by rank."""
    if report.plan_fingerprint != plan.model.fingerprint:
        raise PlanFileError(f"the run report is of model {report.plan_fingerprint[:12]}... but the "
                            f"plan is of {plan.model.fingerprint[:12]}...; give the plan that was run")
    ran = (report.world_size, report.global_batch_size)
    if ran != (plan.layout.world_size, plan.training.global_batch_size):
        raise PlanFileError(f"the run report is of {report.world_size} ranks at batch {report.global_batch_size} "
                            f"but the plan runs {plan.layout.world_size} at batch {plan.training.global_batch_size}; "
                            f"give the plan that was run")
    found = [Check("step time (slowest rank)", None, plan.predicted.step_ms, report.median_step_ms,
                   format_ms),
             Check("samples/s", None, plan.predicted.samples_per_s, report.samples_per_s, _per_second)]
    halos = predicted_halo_bytes(plan)
    spatial = any(part.spatial is not None for part in plan.stages)
    sends = predicted_p2p_bytes(plan) if report.p2p_bytes_sent and not spatial else ()
    idle = predicted_idle_fraction(plan) if report.rank_busy_ms else ()
    if report.bubble_fraction is not None:
        found.append(Check("bubble", None, plan.predicted.bubble_fraction, report.bubble_fraction, _share,
                           points=True))
    if report.bubble_fraction is not None and report.rank_action_ms:
        # the schedule replayed on the run's own compute times: what the transfers, waits and all-reduces
        # add, apart from how well each layer's time was predicted
        replayed = simulate_measured(plan, report.rank_action_ms)
        found.append(Check("step time on measured compute", None, replayed.step_ms, report.median_step_ms,
                           format_ms))
        found.append(Check("bubble on measured compute", None, replayed.bubble_fraction, report.bubble_fraction,
                           _share, points=True))
    for rank, peak_bytes in enumerate(plan.predicted.peak_mem_bytes):
        if report.rank_step_ms:
            found.append(Check("step time", rank, plan.predicted.step_ms, report.rank_median_step_ms[rank],
                               format_ms))
        if idle:
            found.append(Check("idle share", rank, idle[rank], report.rank_idle_fraction[rank], _share,
                               points=True))
        found.append(Check("peak memory", rank, peak_bytes, report.peak_mem_bytes[rank], format_bytes))
        if report.halo_bytes_sent and (halos[rank] or report.halo_bytes_sent[rank]):
            found.append(Check("halo bytes sent", rank, halos[rank], report.halo_bytes_sent[rank],
                               format_bytes))
        if sends and (sends[rank] or report.p2p_bytes_sent[rank]):
            found.append(Check("pipeline bytes sent", rank, sends[rank], report.p2p_bytes_sent[rank],
                               format_bytes))
    return tuple(found)


def predicted_p2p_bytes(plan: Plan) -> tuple[int, ...]:
    """Per rank, the bytes its programs' sends post in one step: per SEND_F the transfer to its peer, per
    SEND_B the gradients of the transfer its peer sent."""
    crossing = {(t.src_stage, t.dst_stage): t for t in plan.transfers}
    sent = []
    for program in parse_programs(plan.programs):
        total = 0
        for action in program:
            if action.kind is ActionKind.SEND_F and (action.stage, action.peer) in crossing:
                total += crossing[(action.stage, action.peer)].nbytes
            elif action.kind is ActionKind.SEND_B and (action.peer, action.stage) in crossing:
                total += crossing[(action.peer, action.stage)].grad_nbytes
        sent.append(total)
    return tuple(sent)


def predicted_halo_bytes(plan: Plan) -> tuple[int, ...]:
    """Per rank, the halo bytes its spatial stages' exchanges send in one step (the plan's per-tile
    count per micro-batch, times the micro-batches)."""
    sent = [0] * plan.layout.world_size
    for part in plan.stages:
        if part.spatial is None or not part.spatial.halo_bytes:
            continue
        for stage in plan.layout.stages_of_part(part.index):
            for replica in range(plan.data_parallel):
                for tile, rank in enumerate(plan.layout.ranks_of(stage, replica)):
                    sent[rank] += part.spatial.halo_bytes[tile] * plan.training.num_microbatches
    return tuple(sent)


def predicted_idle_fraction(plan: Plan) -> tuple[float, ...]:
    """Per rank, the share of the simulated step it is not computing (planner/simulation.py)."""
    simulated = simulate_plan(plan)
    return tuple(1.0 - busy / simulated.step_ms if simulated.step_ms else 0.0 for busy in simulated.busy_ms)


def worst(found: Sequence[Check]) -> Check:
    """The check with the largest error magnitude (the first of equals)."""
    return max(found, key=lambda check: abs(check.error_pct))


def verdict(found: Sequence[Check], tolerance_pct: float) -> str | None:
    """One line naming the worst check when its error is above ``tolerance_pct``; None when all are within."""
    beyond = [check for check in found if abs(check.error_pct) > tolerance_pct]
    if not beyond:
        return None
    check = worst(found)
    return (f"{check.label} is off by {_error(check)} (predicted {check.show(check.predicted)}, "
            f"measured {check.show(check.measured)}), above the tolerance of {tolerance_pct:g}%; "
            f"{len(beyond)} of {len(found)} checks are beyond it")


def compare(plan: Plan, report: RunReport) -> str:
    """The side-by-side table: one line per check, the worst marked, then what is not checked.

    Example::

        print(compare(Plan.load("plan.json"), RunReport.load("run.json")))
    """
    found = checks(plan, report)
    marked = worst(found)
    width = max(len(check.label) for check in found)
    lines = [f"{'':{width}}  {'predicted':>12}  {'measured':>12}  {'error':>8}"]
    lines += [f"{check.label:{width}}  {check.show(check.predicted):>12}  {check.show(check.measured):>12}  "
              f"{_error(check):>8}  {WORST_MARK if check is marked else ''}".rstrip()
              for check in found]
    if report.held_mem_bytes:
        lines.append("runtime holds at most (model state, saved activations, its own buffers; per rank): "
                     + ", ".join(format_bytes(held) for held in report.held_mem_bytes))
    for rank, (host, nvme) in enumerate(zip(report.optimizer_host_bytes, report.optimizer_nvme_bytes)):
        lines.append(f"rank {rank} optimizer state off the device: {format_bytes(host)} in host memory, "
                     f"{format_bytes(nvme)} on NVMe")
    unchecked = [] if report.rank_busy_ms else [f"the bubble ({plan.predicted.bubble_fraction:.1%} predicted; "
                                                f"the run report holds no busy time, kept on CPU only)"]
    if not report.p2p_bytes_sent:
        unchecked.append("the pipeline's point-to-point bytes (the run report does not count them)")
    if unchecked:
        lines.append(f"not checked: {' and '.join(unchecked)}")
    lines.append(f"measured on {report.device} over {len(report.timed_ms)} timed steps (median; "
                 f"{report.warmup_steps} warm-up step(s) excluded); memory: {report.memory_measure}; "
                 f"error = (measured - predicted) / predicted")
    return "\n".join(lines)


def _percent(error_pct: float) -> str:
    return f"{error_pct:+.1f}%"


def _error(check: Check) -> str:
    return f"{check.error_pct:+.1f} pt" if check.points else _percent(check.error_pct)


def _share(value: float) -> str:
    return f"{value:.1%}"


def _per_second(value: float) -> str:
    return f"{value:.1f}"
