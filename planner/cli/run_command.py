"""`tessera run` (torchrun's agent, supervised) and `tessera validate` (predicted vs measured, a verdict).

`tessera run` checks what it can before any process starts (the world size, the plan's
consistency, the builder and the model's fingerprint: planner/preflight.py), then starts
``python -m runtime.agent`` (torch.distributed.run's agent, whose exit status is the first failed
rank's: runtime/agent.py) in a session of its own, so a terminal's Ctrl-C reaches `tessera`
alone. On SIGINT or SIGTERM it sends SIGTERM to the agent's group (the agent stops every rank:
SIGTERM, then SIGKILL after ``AGENT_SHUTDOWN_S``), waits for it with a timeout, then kills what
is left, prints one line and exits 128 + the signal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from cost_models.errors import InvalidArgument, RuntimeSetupError
from planner.plan import Plan

AGENT_SHUTDOWN_S = 15  # the agent's SIGTERM-to-SIGKILL grace for its ranks
STOP_TIMEOUT_S = 30.0  # how long `tessera run` waits for the agent to stop before killing it
EXIT_OFF_TOLERANCE = 1  # `tessera validate --tolerance`: a measurement is further from its prediction


class Rendezvous(str, Enum):
    """torchrun's rendezvous backends: c10d numbers the nodes itself, static takes --node-rank."""

    C10D = "c10d"
    STATIC = "static"


@dataclass(frozen=True)
class Nodes:
    """The machines of one job: this one alone, or ``count`` joined by torchrun's rendezvous.

    Every node runs `tessera run` with the same arguments (``node_rank`` aside): ``endpoint`` is
    ``HOST:PORT`` that every node reaches (c10d: the rendezvous store, hosted by the node whose
    address it is; static: node 0's address, ``node_rank`` then orders the nodes).
    """

    count: int = 1
    endpoint: str | None = None
    backend: Rendezvous = Rendezvous.C10D
    job_id: str | None = None
    node_rank: int | None = None

    def check(self) -> None:
        if self.count < 1:
            raise InvalidArgument(f"--nnodes must be >= 1, got {self.count}")
        if self.count > 1 and not self.endpoint:
            raise InvalidArgument(f"--nnodes {self.count} needs --rdzv-endpoint HOST:PORT, an address "
                                  f"of the first node that every node can reach")
        if self.backend is Rendezvous.STATIC and self.count > 1 and self.node_rank is None:
            raise InvalidArgument(f"--rdzv-backend static needs --node-rank (0 to {self.count - 1}) "
                                  f"on every node")
        if self.node_rank is not None and self.backend is not Rendezvous.STATIC:
            raise InvalidArgument("--node-rank is for --rdzv-backend static; the c10d rendezvous numbers "
                                  "the nodes itself")
        if self.node_rank is not None and not 0 <= self.node_rank < self.count:
            raise InvalidArgument(f"--node-rank {self.node_rank} is not in 0..{self.count - 1} "
                                  f"(--nnodes {self.count})")

    def torchrun_args(self) -> list[str]:
        """torchrun's rendezvous arguments: ``--standalone`` for one node without an endpoint."""
        if self.count == 1 and self.endpoint is None:
            return ["--standalone"]
        args = ["--nnodes", str(self.count), "--rdzv-backend", self.backend.value, "--rdzv-endpoint",
                str(self.endpoint)]
        args += ["--rdzv-id", self.job_id] if self.job_id else []
        args += ["--node-rank", str(self.node_rank)] if self.node_rank is not None else []
        return args


@dataclass(frozen=True)
class RunRequest:
    """What `tessera run` was asked: the plan, processes per node, steps, nodes, runtime flags."""

    plan_path: Path
    steps: int = 10
    nproc: int | None = None
    nodes: Nodes = field(default_factory=Nodes)
    runtime_args: tuple[str, ...] = ()


def agent_command(request: RunRequest, nproc: int) -> list[str]:
    """The command line of torchrun's agent that trains the plan (``nproc`` ranks on this node).

    >>> agent_command(RunRequest(Path("p.json"), 5, runtime_args=("--seed", "1")), 2)[1:6]
    ['-m', 'runtime.agent', '--standalone', '--nproc-per-node', '2']
    """
    return [sys.executable, "-m", "runtime.agent", *request.nodes.torchrun_args(),
            "--nproc-per-node", str(nproc), "--shutdown-timeout", str(AGENT_SHUTDOWN_S),
            "-m", "runtime", str(request.plan_path), "--steps", str(request.steps),
            *request.runtime_args]


def run_plan(request: RunRequest) -> int:
    """Check the plan, then train it under torchrun's agent; the job's exit status."""
    request.nodes.check()
    plan = Plan.load(request.plan_path)
    nproc = processes_per_node(plan, request)
    if request.steps < 1:
        raise InvalidArgument(f"--steps must be >= 1, got {request.steps}")
    check_before_launch(plan, request, nproc)
    return supervise(agent_command(request, nproc))


def processes_per_node(plan: Plan, request: RunRequest) -> int:
    """``--nproc``, or the plan's ranks spread evenly over the nodes."""
    world_size = plan.layout.world_size
    nodes = request.nodes.count
    if request.nproc is not None:
        if request.nproc < 1:
            raise InvalidArgument(f"--nproc must be >= 1, got {request.nproc}")
        return request.nproc
    if world_size % nodes:
        raise InvalidArgument(f"the plan's {world_size} ranks do not split evenly over --nnodes {nodes}; "
                              f"give --nproc for this node")
    return world_size // nodes


def check_before_launch(plan: Plan, request: RunRequest, nproc: int) -> None:
    """What the ranks would refuse, found here in one process: world size, plan, builder, fingerprint, and a
    model returning more than the one tensor the synthetic loss takes."""
    launched = nproc * request.nodes.count
    if launched != plan.layout.world_size:
        per_node = plan.layout.world_size / request.nodes.count
        fix = f"--nproc {int(per_node)}" if per_node.is_integer() else "other --nproc/--nnodes"
        raise RuntimeSetupError(f"the plan is for {plan.layout.world_size} processes ({plan.layout.describe()}) "
                                f"but --nproc {nproc} x {request.nodes.count} node(s) launches {launched}; run "
                                f"with {fix}, or re-plan for {launched} GPUs")
    from planner.preflight import check_one_output, check_plan, rebuild_model, trace_checked  # imports torch

    check_plan(plan)
    from planner.nvme_dir import check_nvme_dir

    check_nvme_dir(plan, _nvme_dir(request.runtime_args), range(plan.num_parts))
    check_one_output(trace_checked(rebuild_model(plan, Path.cwd()), plan, _leaf_modules(request.runtime_args)))


def _leaf_modules(runtime_args: Sequence[str]) -> tuple[str, ...]:
    """The ``--leaf`` flags among the runtime's arguments (the model is traced with them)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--leaf", action="append", default=[])
    return tuple(parser.parse_known_args(list(runtime_args))[0].leaf)


def _nvme_dir(runtime_args: Sequence[str]) -> Path | None:
    """The ``--nvme-dir`` among the runtime's arguments (checked here before any rank starts)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--nvme-dir", type=Path, default=None)
    return parser.parse_known_args(list(runtime_args))[0].nvme_dir


class _Signalled(BaseException):
    """SIGINT or SIGTERM reached `tessera run` while the job runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def supervise(command: Sequence[str], stop_timeout_s: float = STOP_TIMEOUT_S) -> int:
    """Run the agent in its own session; on SIGINT/SIGTERM stop it and every rank, say so in one line."""
    agent: subprocess.Popen[bytes] | None = None
    try:
        with _signals_raised():
            agent = subprocess.Popen(list(command), start_new_session=True)
            return agent.wait()
    except _Signalled as stop:
        with _signals_ignored():
            if agent is not None:
                stop_job(agent, stop_timeout_s)
        print(f"tessera: {'interrupted' if stop.signum == signal.SIGINT else 'terminated'}",
              file=sys.stderr, flush=True)
        return 128 + stop.signum


def stop_job(agent: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM to the agent's group (it stops its ranks, each in a session of its own); after
    ``timeout_s`` SIGKILL the agent and every rank it still has."""
    ranks = child_pids(agent.pid)
    _signal_group(agent.pid, signal.SIGTERM)
    try:
        agent.wait(timeout_s)
        return
    except subprocess.TimeoutExpired:
        ranks = child_pids(agent.pid) or ranks
    for rank_pid in ranks:
        _signal_group(rank_pid, signal.SIGKILL)
    _signal_group(agent.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):  # a process stuck in the kernel outlives SIGKILL
        agent.wait(timeout_s)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc; [] where there is none)."""
    children = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            children.append(int(entry.parent.name))
    return children


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


@contextlib.contextmanager
def _signals_raised() -> Iterator[None]:
    """SIGINT and SIGTERM raise _Signalled in the block (a SIGINT that was ignored stays ignored)."""
    def handler(signum: int, frame: object) -> None:
        raise _Signalled(signum)

    with _handlers(handler):
        yield


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """A second Ctrl-C does not cut the bounded stop short (and orphan the ranks)."""
    with _handlers(signal.SIG_IGN):
        yield


@contextlib.contextmanager
def _handlers(handler: object) -> Iterator[None]:
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(signum) is not signal.SIG_IGN}
    for signum in previous:
        signal.signal(signum, handler)  # type: ignore[arg-type]
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def run_validate(plan_path: Path, report_path: Path, tolerance_pct: float | None = None) -> int:
    """Print the predicted-vs-measured table; with a tolerance, exit 1 (after one line naming the
    worst check) when an error is above it."""
    from planner.reports.compare import checks, compare, verdict
    from planner.reports.run_report import RunReport

    if tolerance_pct is not None and not 0 <= tolerance_pct < float("inf"):
        raise InvalidArgument(f"--tolerance must be a percentage >= 0, got {tolerance_pct:g}; "
                              f"e.g. --tolerance 10")
    plan, report = Plan.load(plan_path), RunReport.load(report_path)
    print(compare(plan, report))
    failed = verdict(checks(plan, report), tolerance_pct) if tolerance_pct is not None else None
    if failed is not None:
        print(f"tessera: validate: {failed}", file=sys.stderr)
        return EXIT_OFF_TOLERANCE
    return 0
