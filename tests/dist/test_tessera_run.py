"""The `tessera` console script's `run`: signals, refusals, resume, and two nodes on the loopback.

Each test starts the real console script in a subprocess (gloo, CPU, one thread per process) on a
2-stage GPT plan, or on 2 stages x 2 replicas for the two-node job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from planner.reports.run_report import RunReport
from tests.runtime_plans import GPT, make_plan

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
TESSERA = str(Path(sys.executable).with_name("tessera"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def tessera(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([TESSERA, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env=ENV, check=False)


def said(stderr: str) -> list[str]:
    """stderr's lines, without the lines libkineto prints around the profiled (last) CPU step
    (two ranks' halves of them may interleave into blank lines)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("USDT:")]


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("plans")
    texts = {"gpt2": make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b"),
             "cut_elsewhere": make_plan(GPT, ["blocks_0_attn_qkv"], schedule="1f1b"),
             "gpt2x2": make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", data_parallel=2, microbatches=2)}
    data = json.loads(texts["gpt2"])
    data["model"]["builder_kwargs"]["vocab"] = 256
    texts["changed"] = json.dumps(data)
    data = json.loads(texts["gpt2"])
    data["training"]["global_batch_size"] = 7
    texts["inconsistent"] = json.dumps(data)
    data = json.loads(texts["gpt2"])
    data["model"]["builder"] = data["model"]["builder_relative"] = "examples/models/absent.py:gpt_tiny"
    texts["no_builder"] = json.dumps(data)
    for name, text in texts.items():
        (folder / f"{name}.json").write_text(text)
    return {name: folder / f"{name}.json" for name in texts}


# ------------------------------------------------------------------- signals
def _job_processes(plan: Path) -> list[int]:
    """Live processes (torchrun's agent and the ranks) whose command line names ``plan``."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(plan).encode() in command and TESSERA.encode() not in command and state != "Z":
            found.append(int(entry.name))
    return found


def _started(out: Path, plan: Path, deadline_s: float) -> list[int]:
    """Wait for the first step to be logged; the job's processes then."""
    end = time.monotonic() + deadline_s
    while "step 1/" not in out.read_text():
        assert time.monotonic() < end, f"no step within {deadline_s} s: {out.read_text()}"
        time.sleep(0.2)
    return _job_processes(plan)


@contextlib.contextmanager
def _long_run(plan: Path, tmp_path: Path, **popen: Any) -> Iterator[tuple[subprocess.Popen, Path, list[int]]]:
    """`tessera run` of ``plan`` for many steps: the process, its stderr's file and, once its first step is logged,
    the job's processes; whatever of it is left is killed on the way out."""
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen([TESSERA, "run", str(plan), "--steps", "100000"], cwd=ROOT, stdout=stdout,
                                   stderr=stderr, env=ENV, start_new_session=True, **popen)
    try:
        yield process, err, _started(out, plan, 120)
    finally:
        for pid in [process.pid, *_job_processes(plan)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize(("signum", "line"), [(signal.SIGINT, "tessera: interrupted"),
                                              (signal.SIGTERM, "tessera: terminated")])
def test_a_signal_to_tessera_run_stops_every_rank_and_says_one_line(
        plans: dict[str, Path], tmp_path: Path, signum: int, line: str) -> None:
    with _long_run(plans["gpt2"], tmp_path,
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as (process, err, job):
        assert len(job) == 3, f"expected the agent and 2 ranks, found pids {job}"
        os.killpg(process.pid, signum)  # to tessera's process group, as a terminal's Ctrl-C
        assert process.wait(timeout=60) == 128 + signum
        assert said(err.read_text()) == [line]
        assert _job_processes(plans["gpt2"]) == [], "ranks outlived `tessera run`"


def _rank_pid(pids: list[int], rank: int) -> int:
    """Which of ``pids`` is the job's rank ``rank`` (torchrun's agent has no RANK in its environment)."""
    for pid in pids:
        environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} among pids {pids}")


def test_a_rank_killed_mid_run_is_named_and_every_rank_exits_promptly(plans: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """Rank 1 is killed by SIGKILL: rank 0, left waiting for its messages, says so and fails too; the agent names
    the killed rank (before, it named rank 0 alone when both failures fell in the same second)."""
    with _long_run(plans["gpt2"], tmp_path) as (process, err, job):
        killed = _rank_pid(job, 1)
        os.kill(killed, signal.SIGKILL)
        assert process.wait(timeout=60) == 1
        lines = said(err.read_text())
        assert f"tessera: rank 1 (pid {killed}) was killed by SIGKILL" in lines, lines
        assert _job_processes(plans["gpt2"]) == [], "ranks outlived `tessera run`"


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(("plan", "args", "message"), [
    ("gpt2", ["--nproc", "1"], "the plan is for 2 processes (2 stages x 1 data-parallel) but "
                               "--nproc 1 x 1 node(s) launches 1; run with --nproc 2"),
    ("changed", [], "the rebuilt model's graph fingerprint"),
    ("inconsistent", [], "plan field training.global_batch_size is 7, but micro_batch_size 2 x "
                         "num_microbatches 4 x the layout's 1 data-parallel replicas = 8"),
    ("no_builder", [], "model file 'examples/models/absent.py' does not exist"),
])
def test_what_tessera_run_can_check_is_refused_before_launch_in_one_line(
        plans: dict[str, Path], plan: str, args: list[str], message: str) -> None:
    began = time.monotonic()
    result = tessera("run", str(plans[plan]), "--steps", "1", *args)
    assert result.returncode == 2, result.stderr
    assert _one_error_line(result.stderr, message) and result.stdout == ""
    assert time.monotonic() - began < 60


def _one_error_line(stderr: str, message: str) -> bool:
    lines = said(stderr)
    return len(lines) == 1 and lines[0].startswith("tessera: error: ") and message in lines[0]


def test_a_refusal_only_the_ranks_can_make_is_one_line_and_exit_2(plans: dict[str, Path]) -> None:
    result = tessera("run", str(plans["gpt2"]), "--steps", "1", "--", "--resume")
    assert result.returncode == 2, result.stderr
    assert said(result.stderr) == ["tessera: error: --resume needs --checkpoint-dir DIR, the directory whose "
                                   "newest checkpoint to continue from (see 'python -m runtime --help')"]


def test_a_failing_rank_exits_1_without_torchruns_report(plans: dict[str, Path]) -> None:
    # --steps 3: the profiled (last) step is never reached, so no libkineto line can interleave
    # with the failing rank's
    result = tessera("run", str(plans["gpt2"]), "--steps", "3", "--", "--fail-at-step", "1",
                     "--fail-rank", "1")
    assert result.returncode == 1
    assert said(result.stderr)[0] == "tessera: rank 1 failed:", result.stderr
    assert result.stderr.count("injected failure on rank 1") == 1
    assert "ChildFailedError" not in result.stderr and "torch/distributed/run.py" not in result.stderr


# -------------------------------------------------------------------- resume
@pytest.fixture(scope="module")
def checkpoints(plans: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("checkpoints")
    result = tessera("run", str(plans["gpt2"]), "--steps", "2", "--", "--checkpoint-dir", str(folder))
    assert result.returncode == 0, result.stderr
    return folder


@pytest.mark.parametrize(("plan", "steps", "message"), [
    ("gpt2", "1", "its newest checkpoint is at step 2, so --steps 1 leaves nothing to train; pass --steps "
                  "above 2"),
    ("cut_elsewhere", "3", "its checkpoint was written by a plan that cuts the model into 2 stages "
                           "starting at ['idx', 'blocks_1_ln_1'], but this plan's 2 stages start at "
                           "['idx', 'blocks_0_attn_qkv']"),
])
def test_resuming_what_cannot_be_resumed_is_one_line_and_exit_2(
        plans: dict[str, Path], checkpoints: Path, plan: str, steps: str, message: str) -> None:
    result = tessera("run", str(plans[plan]), "--steps", steps, "--", "--checkpoint-dir", str(checkpoints),
                     "--resume")
    assert result.returncode == 2, result.stderr
    assert _one_error_line(result.stderr, f"cannot resume from {checkpoints}: {message}")
    assert "step " not in result.stdout


def test_resuming_from_an_empty_directory_says_so_and_starts_at_step_1(plans: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    result = tessera("run", str(plans["gpt2"]), "--steps", "1", "--", "--checkpoint-dir", str(tmp_path),
                     "--resume")
    assert result.returncode == 0, result.stderr
    assert said(result.stderr) == [f"tessera: --resume found no checkpoint in {tmp_path} (no latest.json); "
                                   f"starting from step 1"]
    assert result.stdout.startswith("step 1/1")


# ----------------------------------------------------------------- two nodes
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def one_node(plans: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> RunReport:
    """The 2 x 2 plan as 4 processes of one `tessera run`."""
    report = tmp_path_factory.mktemp("one_node") / "run.json"
    result = tessera("run", str(plans["gpt2x2"]), "--steps", "2", "--", "--report", str(report))
    assert result.returncode == 0, result.stderr
    return RunReport.load(report)


@pytest.mark.parametrize("rendezvous", [["--rdzv-backend", "c10d"],
                                        ["--rdzv-backend", "static", "--node-rank"]])
def test_two_tessera_runs_on_the_loopback_are_one_job_with_the_losses_of_one_node(
        plans: dict[str, Path], one_node: RunReport, tmp_path: Path, rendezvous: list[str]) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = []
    for node in range(2):
        flags = [*rendezvous, str(node)] if rendezvous[-1] == "--node-rank" else rendezvous
        nodes.append(subprocess.Popen(
            [TESSERA, "run", str(plans["gpt2x2"]), "--steps", "2", "--nnodes", "2", "--rdzv-endpoint",
             endpoint, *flags, "--", "--report", str(tmp_path / "two_nodes.json")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV))
    outcomes = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outcomes
    assert sum(out.count("step 2/2") for out, _ in outcomes) == 1  # rank 0 logs, on one of the nodes
    two_nodes = RunReport.load(tmp_path / "two_nodes.json")
    assert two_nodes.world_size == one_node.world_size == 4
    np.testing.assert_allclose(two_nodes.losses, one_node.losses, rtol=1e-12, atol=0)


def test_the_run_report_times_each_ranks_compute_and_validate_checks_the_bubble(
        plans: dict[str, Path], one_node: RunReport) -> None:
    """On CPU every rank's compute actions are timed: busy within its own step, every step; validate then
    checks the job's bubble and each rank's idle share against the plan's simulated ones."""
    from planner.plan import Plan
    from planner.reports.compare import checks

    assert len(one_node.rank_busy_ms) == 4
    for busy, steps in zip(one_node.rank_busy_ms, one_node.rank_step_ms):
        assert len(busy) == len(steps) and all(0 < b < s for b, s in zip(busy, steps))
    assert 0 < one_node.bubble_fraction < 1
    plan = Plan.load(plans["gpt2x2"])
    for rank, times in enumerate(one_node.rank_action_ms):  # each rank timed its own stage's F, B, step, posts
        stage = plan.layout.stages_of_rank(rank)[0]
        assert set(times) == {f"{stage}:F", f"{stage}:B", f"{stage}:OPTIMIZER_STEP", "post"}
        assert all(ms > 0 for ms in times.values()) and times["post"] < one_node.median_step_ms
    labels = {check.label for check in checks(plan, one_node)}
    assert {"bubble", "bubble on measured compute", *(f"rank {rank} idle share" for rank in range(4))} <= labels


def test_each_rank_posts_the_pipeline_bytes_the_plan_predicts(plans: dict[str, Path], one_node: RunReport) -> None:
    """The run report counts each rank's pipeline sends in the last step; on the GPT plan (2 stages x 2
    replicas, only float values cross the cut) they equal the plan's transfers exactly, and validate
    checks them per rank."""
    from planner.plan import Plan
    from planner.reports.compare import checks, predicted_p2p_bytes

    plan = Plan.load(plans["gpt2x2"])
    predicted = predicted_p2p_bytes(plan)
    assert all(predicted) and one_node.p2p_bytes_sent == predicted
    sent = [check for check in checks(plan, one_node) if check.metric == "pipeline bytes sent"]
    assert len(sent) == 4 and all(check.error_pct == 0 for check in sent)


def test_a_wpipe_plan_runs_ahead_across_steps_and_sends_the_bytes_of_a_steady_step(tmp_path: Path) -> None:
    """`tessera run` gives a WPipe plan each next step's micro-batches (its first group's forwards run ahead)
    and flushes on the last; the report counts a steady step's pipeline bytes, the plan's exactly (ResNet:
    only float values cross its cuts). Its checkpoints: tests/dist/test_wpipe.py."""
    from planner.plan import Plan
    from planner.reports.compare import predicted_p2p_bytes
    from tests.runtime_plans import RESNET, searched_plan

    plan_file, report = tmp_path / "wpipe.json", tmp_path / "run.json"
    plan_file.write_text(searched_plan(RESNET, gpus=2, budget_share=4.0, offload=(), schedule="wpipe", batch_size=8,
                                       micro_batch_size=2, allow_stale_weights=True))
    result = tessera("run", str(plan_file), "--steps", "3", "--", "--report", str(report))
    assert result.returncode == 0, result.stderr
    ran = RunReport.load(report)
    assert len(ran.losses) == 3 and np.all(np.isfinite(ran.losses))
    assert ran.p2p_bytes_sent == predicted_p2p_bytes(Plan.load(plan_file))
