"""The synthetic training loop behind ``python -m runtime``: steps, checkpoints, the run report."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from planner.plan import Plan
from planner.preflight import check_one_output
from planner.schedules import ActionKind
from runtime import checkpoint
from runtime.build import rebuild_model
from runtime.data import SyntheticData, input_specs, synthetic_task
from runtime.executor import Executor
from runtime.microbatch import Microbatch
from runtime.optim import optimizer_factory
from runtime.report import RunReport, gather_report


@dataclass(frozen=True)
class RunOptions:
    """What `python -m runtime` was asked to do (see runtime/command.py for the flags)."""

    plan: Path
    steps: int
    report: Path | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 10
    resume: bool = False
    seed: int = 0
    lr: float | None = None
    timeout_s: float = 300.0
    leaf_modules: tuple[str, ...] = ()
    nvme_dir: Path | None = None  # where stages with optimizer_state nvme page it
    fail_at_step: int | None = None  # test hook: raise on ``fail_rank`` before this step
    fail_rank: int = 0


def run(plan: Plan, options: RunOptions, device: torch.device) -> RunReport:
    """Train the plan's model on synthetic data for ``options.steps`` steps (collective).

    A plan whose forwards run ahead (WPipe) is given each next step's micro-batches but on the last step and
    on those a checkpoint follows (it flushes: a checkpoint holds no forward run ahead, and the next step runs
    them first, as a resumed run does; the weights each forward reads are the same); its memory is measured on
    the last step that runs ahead."""
    start = _resume_step(plan, options)
    executor, data = prepare(plan, options, device)
    if start:
        assert options.checkpoint_dir is not None
        checkpoint.restore(executor, options.checkpoint_dir, start)
    crossing = executor.crosses_steps
    ahead = [step for step in range(start, options.steps) if crossing and not _flushes(step, options)]
    measured = ahead[-1] if ahead else options.steps - 1  # the step whose memory is measured
    timings, losses = StepTimings(), []
    p2p_bytes_sent = 0
    for step in range(start, options.steps):
        if options.fail_at_step == step and executor.rank == options.fail_rank:
            raise RuntimeError(f"injected failure on rank {executor.rank} before step {step} "
                               f"(--fail-at-step)")
        profiled = device.type == "cpu" and step == measured  # memory peak (runtime/memory.py)
        microbatches = step_microbatches(executor, data, step)
        following = step_microbatches(executor, data, step + 1) if step in ahead else None
        began = time.perf_counter()
        losses.append(executor.run(microbatches, profile_memory=profiled, next_microbatches=following))
        if step == measured:
            p2p_bytes_sent = executor.p2p_bytes_sent  # a steady step's (a flush sends less)
        elapsed_ms = (time.perf_counter() - began) * 1e3
        if not profiled or step == start:  # the profiler slows its step down: not timed
            timings.add(executor, elapsed_ms)
        _log(executor, step, options.steps, losses[-1], elapsed_ms)
        if options.checkpoint_dir and _checkpoint_due(step + 1, options):
            checkpoint.save(executor, options.checkpoint_dir, step + 1)
    states = [stage.state for stage in executor.stages.values() if stage.state is not None]
    return gather_report(timings.step_ms, losses, executor.memory.peak_bytes, executor.memory.held_bytes,
                         fingerprint=plan.model.fingerprint, device=device,
                         global_batch_size=plan.training.global_batch_size, start_step=start,
                         host_swap_bytes=executor.swaps.step_bytes, halo_bytes_sent=executor.halo_bytes_sent,
                         p2p_bytes_sent=p2p_bytes_sent, busy_ms=timings.busy_ms, action_ms=timings.summary(),
                         optimizer_bytes=(sum(s.host_bytes for s in states), sum(s.nvme_bytes for s in states)))


def prepare(plan: Plan, options: RunOptions, device: torch.device) -> tuple[Executor, SyntheticData]:
    """This rank's executor of ``plan`` (collective: every rank builds its own) and the synthetic data it
    trains on, its loss bound to the model's output."""
    model = rebuild_model(plan, Path.cwd())
    executor = Executor(plan, model, _unbound_loss, optimizer_factory(plan.training.optimizer, options.lr),
                        seed=options.seed, device=device, timeout_s=options.timeout_s,
                        leaf_modules=options.leaf_modules, nvme_dir=options.nvme_dir)
    check_one_output(executor.traced)
    output = executor.flow.specs[executor.flow.output_names[0]]
    data = SyntheticData(input_specs(executor.traced, dict(executor.flow.specs)), synthetic_task(output),
                         options.seed)
    executor.loss_fn = data.task
    return executor, data


@dataclass
class StepTimings:
    """What one rank's executor measured over its timed steps, for the run report."""

    step_ms: list[float] = field(default_factory=list)  # wall time of each step
    busy_ms: list[float] = field(default_factory=list)  # per step, its compute actions (Executor.busy_ms)
    action_ms: list[dict[tuple[int, ActionKind], list[float]]] = field(default_factory=list)  # Executor.action_ms
    post_ms: list[float | None] = field(default_factory=list)  # per step, the mean post of one message

    def add(self, executor: Executor, elapsed_ms: float) -> None:
        """Record the step ``executor`` just ran, which took ``elapsed_ms``."""
        self.step_ms.append(elapsed_ms)
        self.busy_ms.append(executor.busy_ms)
        self.action_ms.append(executor.action_ms)
        self.post_ms.append(executor.post_ms)

    def summary(self) -> dict[str, float]:
        """The run report's ``action_ms``: per "stage:kind", the median time of one action, and under "post"
        the mean wall time of posting one message (a step pays the sum of its posts), where any posted; over
        the timed steps after the first (which warms up, as the run report's warm-up step; all of them if
        there is only one)."""
        every: dict[str, list[float]] = {}
        for actions in self.action_ms[1:] or self.action_ms:
            for (stage, kind), took in actions.items():
                every.setdefault(f"{stage}:{kind.value}", []).extend(took)
        summary = {key: statistics.median(took) for key, took in every.items()}
        posts = [ms for ms in self.post_ms[1:] or self.post_ms if ms is not None]
        return {**summary, "post": statistics.mean(posts)} if posts else summary


def _resume_step(plan: Plan, options: RunOptions) -> int:
    """The step ``--resume`` continues from (checked before any set-up), or 0."""
    if not options.resume:
        return 0
    assert options.checkpoint_dir is not None  # the flags require it (runtime/command.py)
    saved = checkpoint.latest(options.checkpoint_dir)
    if saved is None:
        if dist.get_rank() == 0:
            print(f"tessera: --resume found no checkpoint in {options.checkpoint_dir} (no latest.json); "
                  f"starting from step 1", file=sys.stderr, flush=True)
        return 0
    checkpoint.check_resumable(saved, plan, options.steps, options.checkpoint_dir)
    return saved.step


def _unbound_loss(output: object, target: object) -> torch.Tensor:
    raise AssertionError("the synthetic loss is bound once the model output is known")


def step_microbatches(executor: Executor, data: SyntheticData, step: int) -> list[Microbatch]:
    """This rank's micro-batches of ``step`` (its replica's share of the global batch)."""
    count = executor.plan.training.num_microbatches
    return [data.microbatch(step, executor.replica * count + m, inputs=executor.needs_inputs,
                            targets=executor.needs_targets) for m in range(count)]


def _flushes(step: int, options: RunOptions) -> bool:
    """Whether step ``step`` (from 0) of a plan whose forwards run ahead flushes: the last, or a checkpoint's."""
    return step + 1 == options.steps or bool(options.checkpoint_dir and _checkpoint_due(step + 1, options))


def _checkpoint_due(done: int, options: RunOptions) -> bool:
    return done == options.steps or (options.checkpoint_every > 0 and done % options.checkpoint_every == 0)


def _log(executor: Executor, step: int, steps: int, loss: float, ms: float) -> None:
    if executor.rank == 0:
        print(f"step {step + 1}/{steps}  loss {loss:.6f}  {ms:.1f} ms", flush=True)
