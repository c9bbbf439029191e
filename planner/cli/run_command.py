"""`tessera run` (a thin wrapper over torchrun) and `tessera validate` (predicted vs measured)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from cost_models.errors import InvalidArgument


def torchrun_command(plan_path: Path, nproc: int, steps: int, runtime_args: Sequence[str]) -> list[str]:
    """The torchrun command line that trains ``plan_path`` on this machine.

    >>> torchrun_command(Path("p.json"), 2, 5, ["--report", "r.json"])[1:5]
    ['-m', 'torch.distributed.run', '--standalone', '--nproc-per-node']
    """
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "runtime", str(plan_path), "--steps", str(steps), *runtime_args]


def run_torchrun(plan_path: Path, nproc: int | None, steps: int, runtime_args: Sequence[str]) -> int:
    """Start torchrun (one process per GPU of the plan unless ``nproc`` says otherwise); its exit code."""
    from planner.plan.document import Plan

    plan = Plan.load(plan_path)
    count = plan.cluster.gpus if nproc is None else nproc
    if count < 1 or steps < 1:
        raise InvalidArgument(f"--nproc and --steps must be >= 1, got {count} and {steps}")
    return subprocess.call(torchrun_command(plan_path, count, steps, runtime_args))


def run_validate(plan_path: Path, report_path: Path) -> str:
    from planner.plan.document import Plan
    from planner.reports.compare import compare
    from planner.reports.run_report import RunReport

    return compare(Plan.load(plan_path), RunReport.load(report_path))
