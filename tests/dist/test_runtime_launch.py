"""`torchrun -m runtime`: resume after a kill, a failing rank stops the job, set-up mismatches.

Each test starts real torchrun jobs (gloo, CPU, one thread per process) on a 2-stage GPT plan.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from planner.reports.run_report import RunReport
from tests.dist.runtime_cases import Case, reference
from tests.runtime_plans import GPT, make_plan

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
STEPS, KILLED_AT = 5, 3


Run = tuple[subprocess.CompletedProcess, float]


def torchrun(plan: Path, nproc: int, *args: str, timeout_s: float = 120, module: str = "runtime") -> Run:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", module, str(plan), *args]
    began = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    return result, time.monotonic() - began


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "gpt2.json"
    path.write_text(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b"))
    return path


@pytest.fixture(scope="module")
def killed(plan_file: Path,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, float, Path]:
    """A run that checkpoints every step and loses rank 1 before step KILLED_AT."""
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    result, wall_s = torchrun(plan_file, 2, "--steps", str(STEPS), "--checkpoint-dir", str(checkpoints),
                              "--checkpoint-every", "1", "--fail-at-step", str(KILLED_AT), "--fail-rank", "1")
    return result, wall_s, checkpoints


def test_a_failing_rank_stops_every_rank_within_60_s_and_is_reported_once(
        killed: tuple[subprocess.CompletedProcess, float, Path]) -> None:
    result, wall_s, _ = killed
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert wall_s < 60, f"the job took {wall_s:.0f} s to stop"
    assert output.count("RuntimeError: injected failure on rank 1") == 1, output
    assert output.count("tessera: rank 1 failed") == 1, output


def test_resume_after_a_kill_gives_the_losses_of_an_uninterrupted_run(
        plan_file: Path, killed: tuple[subprocess.CompletedProcess, float, Path], tmp_path: Path) -> None:
    _, _, checkpoints = killed
    assert json.loads((checkpoints / "latest.json").read_text())["step"] == KILLED_AT
    resumed, _ = torchrun(plan_file, 2, "--steps", str(STEPS), "--checkpoint-dir", str(checkpoints),
                          "--resume", "--report", str(tmp_path / "resumed.json"))
    straight, _ = torchrun(plan_file, 2, "--steps", str(STEPS), "--report", str(tmp_path / "straight.json"))
    assert resumed.returncode == 0 and straight.returncode == 0, resumed.stderr + straight.stderr
    after_resume = RunReport.load(tmp_path / "resumed.json")
    uninterrupted = RunReport.load(tmp_path / "straight.json")
    assert after_resume.start_step == KILLED_AT
    assert after_resume.losses == uninterrupted.losses[KILLED_AT:]


def test_world_size_and_schema_mismatches_fail_before_any_work(plan_file: Path, tmp_path: Path) -> None:
    result, _ = torchrun(plan_file, 1, "--steps", "1")
    assert result.returncode != 0
    assert (result.stdout + result.stderr).count("the plan is for 2 processes") == 1
    data = json.loads(plan_file.read_text())
    data["schema_version"] = 99
    (tmp_path / "future.json").write_text(json.dumps(data))
    result, _ = torchrun(tmp_path / "future.json", 2, "--steps", "1")
    assert result.returncode != 0
    assert (result.stdout + result.stderr).count("schema_version is 99") == 1


def test_a_model_that_changed_since_planning_is_refused_once(plan_file: Path, tmp_path: Path) -> None:
    data = json.loads(plan_file.read_text())
    data["model"]["builder_kwargs"]["vocab"] = 256
    (tmp_path / "changed.json").write_text(json.dumps(data))
    result, _ = torchrun(tmp_path / "changed.json", 2, "--steps", "1")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("fingerprint") == 1, output
    assert "step 1" not in output


def test_an_executor_in_a_torchrun_script_joins_the_process_group_itself(plan_file: Path) -> None:
    result, _ = torchrun(plan_file, 2, "2", module="tests.dist.executor_script")
    assert result.returncode == 0, result.stdout + result.stderr
    losses = json.loads(result.stdout.split("losses ", 1)[1])
    expected = reference(Case(plan_file.read_text(), steps=2)).losses
    np.testing.assert_allclose(losses, expected, rtol=1e-10, atol=1e-12)
