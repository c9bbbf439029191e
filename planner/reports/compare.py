"""``tessera validate``: a plan's predictions beside what a run measured, with the error of each."""

from __future__ import annotations

from cost_models.errors import PlanFileError
from cost_models.units import format_bytes, format_ms
from planner.plan import Plan
from planner.reports.run_report import RunReport


def compare(plan: Plan, report: RunReport) -> str:
    """The side-by-side table: step time, throughput and per-rank peak memory.

    Example::

        print(compare(Plan.load("plan.json"), RunReport.load("run.json")))
    """
    if report.plan_fingerprint != plan.model.fingerprint:
        raise PlanFileError(f"the run report is of model {report.plan_fingerprint[:12]}... but the "
                            f"plan is of {plan.model.fingerprint[:12]}...; give the plan that was run")
    rows = [("step time", format_ms(plan.predicted.step_ms), format_ms(report.median_step_ms),
             _error(plan.predicted.step_ms, report.median_step_ms), ""),
            ("samples/s", f"{plan.predicted.samples_per_s:.1f}", f"{report.samples_per_s:.1f}",
             _error(plan.predicted.samples_per_s, report.samples_per_s), "")]
    for rank, (predicted, measured) in enumerate(zip(plan.predicted.peak_mem_bytes, report.peak_mem_bytes)):
        held = format_bytes(report.held_mem_bytes[rank]) if report.held_mem_bytes else ""
        rows.append((f"rank {rank} peak memory", format_bytes(predicted), format_bytes(measured),
                     _error(predicted, measured), held))
    width = max(len(row[0]) for row in rows)
    extra = "  runtime holds" if report.held_mem_bytes else ""
    lines = [f"{'':{width}}  {'predicted':>12}  {'measured':>12}  {'error':>8}{extra}"]
    lines += [f"{name:{width}}  {p:>12}  {m:>12}  {e:>8}  {h:>13}".rstrip() for name, p, m, e, h in rows]
    for rank, (host, nvme) in enumerate(zip(report.optimizer_host_bytes, report.optimizer_nvme_bytes)):
        lines.append(f"rank {rank} optimizer state off the device: {format_bytes(host)} in host memory, "
                     f"{format_bytes(nvme)} on NVMe")
    lines.append(f"measured on {report.device} over {len(report.timed_ms)} timed steps (median; "
                 f"{report.warmup_steps} warm-up step(s) excluded); memory: {report.memory_measure}; "
                 f"error = (measured - predicted) / predicted")
    return "\n".join(lines)


def _error(predicted: float, measured: float) -> str:
    if not predicted:
        return "n/a"
    return f"{(measured - predicted) / predicted:+.1%}"
