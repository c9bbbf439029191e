"""tessera's runtime against DistributedDataParallel: a one-stage data-parallel plan, 2 CPU processes.

Both systems train the same model (``runtime.initialize``'s weights) on the same global batch, each
replica its half cut into the same micro-batches, SGD with momentum, on 2 gloo processes with one
intra-op thread each:

* tessera: ``plan_with_split(..., data_parallel=2)`` (one stage, no sharding) under 1F1B, the schedule
  `tessera plan` picks for one stage (GPipe ties on time and holds every micro-batch at once), run by
  the Executor: each micro-batch's forward then its backward, the gradient all-reduce in buckets
  started during the last backward (runtime/grads.py), the optimizer step;
* DDP: ``DistributedDataParallel`` with gradient accumulation (``no_sync()`` on all micro-batches but
  the last, whose backward all-reduces in DDP's buckets), the optimizer step.

The systems alternate step by step (a shared machine's drifts hit both alike), each step between two
barriers; the median step and the spread (min..max) over the timed steps are printed, and the ratio
of tessera's samples/s over DDP's (target >= 1.0).

Run: python benchmarks/runtime_vs_ddp.py [--steps 30] [--quick]   (--quick: GPT only)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime_vs_pipelining import spawned, timed_pair  # noqa: E402

from planner.plan import Plan  # noqa: E402

RANKS, SEED, LR = 2, 0, 1e-3
CASES: dict[str, dict[str, Any]] = {
    "GPT h128 L4": {"builder": "examples/models/gpt.py:gpt", "batch": 16, "micro": 4,
                    "kwargs": {"hidden": 128, "layers": 4, "heads": 4, "seq_len": 64, "vocab": 8192,
                               "dropout": 0.0, "tie_embeddings": False}},
    "ResNet-50 w8 64px": {"builder": "examples/models/resnet.py:resnet50", "batch": 16, "micro": 4,
                          "kwargs": {"width": 8, "num_classes": 10}, "image": 64},
}


def example(case: dict[str, Any]) -> tuple[nn.Module, torch.Tensor]:
    from cost_models.graph.model_spec import build_model, load_builder

    model = build_model(load_builder(case["builder"]), case["kwargs"], "meta")
    if "image" in case:
        return model, torch.empty(1, 3, case["image"], case["image"], device="meta")
    return model, torch.empty(1, case["kwargs"]["seq_len"], dtype=torch.long, device="meta")


def data_parallel_plan(case: dict[str, Any]) -> Plan:
    from planner.manual import plan_with_split

    model, x = example(case)
    return plan_with_split(model, example_inputs=x, stage_starts=[], batch_size=case["batch"],
                           micro_batch_size=case["micro"], data_parallel=RANKS, schedule="1f1b", device="cpu",
                           optimizer="momentum", builder=case["builder"], builder_kwargs=case["kwargs"])


def batch(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    size = case["batch"]
    if "image" in case:
        image = case["image"]
        return (torch.randn(size, 3, image, image, generator=generator),
                torch.randint(0, case["kwargs"]["num_classes"], (size,), generator=generator))
    shape = (size, case["kwargs"]["seq_len"])
    vocab = case["kwargs"]["vocab"]
    return torch.randint(0, vocab, shape, generator=generator), torch.randint(0, vocab, shape, generator=generator)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def tessera_step(plan: Plan, case: dict[str, Any]) -> Callable[[], None]:
    from runtime.build import rebuild_model
    from runtime.executor import Executor

    exe = Executor(plan, rebuild_model(plan), loss_fn, sgd, seed=SEED, timeout_s=120)
    inputs, target = batch(case)
    return lambda: exe.step(inputs, target)


def ddp_step(plan: Plan, case: dict[str, Any]) -> Callable[[], None]:
    """The same model and weights under DDP, this replica's half of the batch in the same micro-batches."""
    from torch.nn.parallel import DistributedDataParallel

    from runtime.build import rebuild_model
    from runtime.weights import initialize

    model = DistributedDataParallel(initialize(rebuild_model(plan), SEED))
    optimizer = sgd(list(model.parameters()))
    inputs, target = batch(case)
    share = case["batch"] // RANKS
    rows = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)
    micro = [(x, y) for x, y in zip(inputs[rows].split(case["micro"]), target[rows].split(case["micro"]))]

    def step() -> None:
        for index, (x, y) in enumerate(micro):
            if index < len(micro) - 1:
                with model.no_sync():
                    (loss_fn(model(x), y) / len(micro)).backward()
            else:
                (loss_fn(model(x), y) / len(micro)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _rank(rank: int, init_file: str, name: str, plan_json: str, steps: int, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=300))
    plan, case = Plan.from_dict(json.loads(plan_json)), CASES[name]
    times = timed_pair({"tessera": tessera_step(plan, case), "ddp": ddp_step(plan, case)}, steps)
    if rank == 0:
        results.put(times)
    dist.barrier()
    dist.destroy_process_group()


def compare(name: str, plan: Plan, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each system, measured in one set of processes."""
    return spawned(_rank, RANKS, name, plan.to_json(), steps)


def arguments(description: str) -> tuple[list[str], int]:
    """The cases (``--quick``: GPT only) and the timed steps per system (``--steps``) the command line asks for."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per system (after 2 warm-up steps)")
    parser.add_argument("--quick", action="store_true", help="GPT only")
    args = parser.parse_args()
    return (list(CASES)[:1] if args.quick else list(CASES)), args.steps


def main() -> None:
    names, steps = arguments(__doc__.splitlines()[0])
    print(f"{RANKS} gloo processes, 1 thread each; {steps} timed steps per system, alternating; "
          f"samples/s of the median step (min..max step ms)")
    print(f"{'model':<20} {'tessera samples/s':>18} {'(ms)':>18} {'DDP samples/s':>14} {'(ms)':>18} "
          f"{'tessera / DDP':>14}")
    for name in names:
        case = CASES[name]
        times = compare(name, data_parallel_plan(case), steps)
        rates = {system: case["batch"] / statistics.median(values) for system, values in times.items()}
        spread = {system: f"{min(values) * 1e3:.1f}..{max(values) * 1e3:.1f}" for system, values in times.items()}
        print(f"{name:<20} {rates['tessera']:>18.1f} {spread['tessera']:>18} {rates['ddp']:>14.1f} "
              f"{spread['ddp']:>18} {rates['tessera'] / rates['ddp']:>13.3f}x")


if __name__ == "__main__":
    main()
