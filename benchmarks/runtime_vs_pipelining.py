"""tessera's runtime against torch.distributed.pipelining: same model, split and schedule, 2 CPU processes.

Both systems run the same two stage modules (one ``split_module`` output), the same weights
(``runtime.initialize``), the same micro-batches, SGD with momentum and the same schedule, on
2 gloo processes with one intra-op thread each. Two splits are compared:

* tessera's: ``plan()``'s search restricted to 2 stages (the ILP's choice on measured CPU costs);
* torch.distributed.pipelining's default: this torch has no automatic split policy (``pipeline()``
  needs ``split_spec`` or ``pipe_split()`` marks), so its former ``split_into_equal_size``
  policy is emulated: the cut that gives both stages equal parameter bytes.

Run: python benchmarks/runtime_vs_pipelining.py [--steps 20] [--schedule 1f1b|gpipe]
(target: tessera / pipelining samples/s >= 1.0 on the same split)
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.plan import Plan

BUILDER = "examples/models/gpt.py:gpt"
MODEL = {"hidden": 128, "layers": 4, "heads": 4, "seq_len": 64, "vocab": 8192, "dropout": 0.0,
         "tie_embeddings": False}
BATCH, MICRO = 16, 4
SEED, LR = 0, 1e-3


def example() -> tuple[nn.Module, torch.Tensor]:
    from cost_models.graph.model_spec import build_model, load_builder

    model = build_model(load_builder(BUILDER), MODEL, "meta")
    return model, torch.empty(1, MODEL["seq_len"], dtype=torch.long, device="meta")


def tessera_plan(schedule: str) -> Plan:
    """plan() restricted to 2 stages x 1 replica: the ILP's split on this machine's CPU costs."""
    from planner.api import plan

    model, x = example()
    return plan(model, 2, "8GB", batch_size=BATCH, example_inputs=x, device="cpu", optimizer="momentum",
                schedules=(schedule,), micro_batch_sizes=(MICRO,), num_stages=(2,), builder=BUILDER,
                builder_kwargs=MODEL)


def equal_parameter_plan(schedule: str) -> Plan:
    """The 2-stage cut with equal parameter bytes (pipelining's former default policy)."""
    from planner.manual import plan_with_split
    from cost_models.graph.tracing import trace

    model, x = example()
    graph = trace(model, x)
    total, running, counted = graph.param_bytes, 0, set()
    for node in graph:
        for name in node.param_names:
            if name not in counted:
                counted.add(name)
                running += graph.parameter(name).nbytes
        if running * 2 >= total:
            start = graph.nodes[graph.nodes.index(node) + 1].name
            break
    return plan_with_split(model, example_inputs=x, stage_starts=[start], batch_size=BATCH,
                           micro_batch_size=MICRO, schedule=schedule, device="cpu",
                           optimizer="momentum", builder=BUILDER, builder_kwargs=MODEL)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq_len"]), generator=generator)
    return tokens, torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq_len"]), generator=generator)


def lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def timed_pair(steps: dict[str, Callable[[], None]], count: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per step of each system, the systems alternating step by step (so drifts in a
    shared machine's speed hit both alike); each step sits between two barriers."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(warmup + count):
        for name, step in steps.items():
            dist.barrier()
            began = time.perf_counter()
            step()
            dist.barrier()
            if index >= warmup:
                times[name].append(time.perf_counter() - began)
    return times


def tessera_step(plan: Plan) -> Callable[[], None]:
    from runtime.build import rebuild_model
    from runtime.executor import Executor

    exe = Executor(plan, rebuild_model(plan), lm_loss, sgd, seed=SEED, timeout_s=120)
    tokens, target = batch()
    return lambda: exe.step(tokens, target)


class _First(nn.Module):
    """A split_module stage returns a tuple; pipelining's last stage hands its output to the loss."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> Any:
        out = self.inner(*args)
        return out[0] if len(out) == 1 else out


def pipelining_step(plan: Plan, schedule: str) -> Callable[[], None]:
    """The same stage module, weights and optimizer under torch.distributed.pipelining."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from runtime.build import rebuild_model, split_stages, trace_checked
    from runtime.weights import initialize

    rank = dist.get_rank()
    model = initialize(rebuild_model(plan), SEED)
    module = _First(split_stages(trace_checked(model, plan), model, plan)[rank])
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    runner = kind(stage, n_microbatches=BATCH // MICRO, loss_fn=lm_loss)
    optimizer = sgd(list(module.parameters()))
    tokens, target = batch()

    def step() -> None:
        if rank == 0:
            runner.step(tokens, return_outputs=False)
        else:
            runner.step(target=target, losses=[], return_outputs=False)  # no output concatenation
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _rank(rank: int, init_file: str, plan_json: str, steps: int, schedule: str, results: Any) -> None:
    import json

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    plan = Plan.from_dict(json.loads(plan_json))
    times = timed_pair({"tessera": tessera_step(plan), "pipelining": pipelining_step(plan, schedule)}, steps)
    if rank == 0:
        results.put(times)
    dist.barrier()
    dist.destroy_process_group()


def spawned(target: Callable[..., None], world: int, *args: Any, timeout_s: float = 1800) -> Any:
    """``target(rank, init_file, *args, results)`` on ``world`` spawned processes (a file rendezvous in a
    scratch folder); what rank 0 puts in ``results``. A process that fails first stops the others and raises
    (its traceback is on stderr), and so does ``timeout_s`` without an answer."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        processes = [context.Process(target=target, args=(rank, str(Path(tmp) / "rdzv"), *args, results))
                     for rank in range(world)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    answer = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    failed = [rank for rank, process in enumerate(processes) if process.exitcode]
                    if failed or time.monotonic() > deadline:
                        raise RuntimeError(f"rank {failed[0]} exited with {processes[failed[0]].exitcode}" if failed
                                           else f"no answer from the ranks within {timeout_s:.0f} s") from None
        except BaseException:
            for process in processes:
                if process.is_alive():
                    process.terminate()
            raise
        for process in processes:
            process.join(timeout=120)
    return answer


def compare_systems(plan: Plan, steps: int, schedule: str) -> tuple[float, float]:
    """Samples/s of tessera and of pipelining (median step), measured in one pair of processes."""
    times = spawned(_rank, 2, plan.to_json(), steps, schedule)
    return (BATCH / statistics.median(times["tessera"]), BATCH / statistics.median(times["pipelining"]))


def describe(plan: Plan) -> str:
    first, second = plan.stages
    return (f"stage 1 starts at {second.nodes[0]}; params {first.predicted.param_bytes / 2**20:.2f} / "
            f"{second.predicted.param_bytes / 2**20:.2f} MiB; predicted fwd+bwd per micro-batch "
            f"{first.predicted.fwd_ms + first.predicted.bwd_ms:.1f} / "
            f"{second.predicted.fwd_ms + second.predicted.bwd_ms:.1f} ms; predicted step "
            f"{plan.predicted.step_ms:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    args = parser.parse_args()
    torch.set_num_threads(1)
    splits = {"tessera (ILP, 2 stages)": tessera_plan(args.schedule),
              "pipelining default (equal parameter bytes, emulated)": equal_parameter_plan(args.schedule)}
    print(f"model: GPT {MODEL}, batch {BATCH} = {BATCH // MICRO} micro-batches of {MICRO}, fp32, "
          f"{args.schedule}, 2 gloo CPU processes x 1 thread; median of {args.steps} steps per system, "
          f"the systems alternating step by step")
    for name, plan in splits.items():
        print(f"split {name}: {describe(plan)}")
    print(f"{'split':<54} {'tessera':>9} {'pipelining':>11} {'ratio':>6}  (samples/s)")
    for name, plan in splits.items():
        ours, theirs = compare_systems(plan, args.steps, args.schedule)
        print(f"{name:<54} {ours:>9.1f} {theirs:>11.1f} {ours / theirs:>6.2f}")


if __name__ == "__main__":
    main()
