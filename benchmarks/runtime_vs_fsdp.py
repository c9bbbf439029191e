"""tessera's ZeRO-3 against FSDP2's ``fully_shard``: a one-stage sharded data-parallel plan, 2 CPU processes.

FSDP2 is what a PyTorch user runs for ZeRO-3. The systems train the same model (``runtime.initialize``'s
weights) on the same global batch, each replica its half cut into the same micro-batches, SGD with momentum,
on 2 gloo processes with one intra-op thread each, the parameters, gradients and optimizer state sharded over
the two ranks:

* tessera: ``plan_with_split(..., data_parallel=2, offload=[OffloadSpec(zero_stage=3)])`` under 1F1B, run by
  the Executor: the plan's gather groups (planner/gathers.py) all-gathered before their layers' forward and
  again for their backward, each micro-batch's gradients reduce-scattered group by group as they are made
  (runtime/layer_gathers.py);
* tessera in FSDP2's groups (:func:`fsdp_grouped`): the same plan gathering one group per block and the rest in
  one, which sets the runtime beside FSDP2's apart from the planner's choice of groups;
* FSDP2: ``fully_shard`` on every block (each child of the model's ``nn.ModuleList`` / ``nn.Sequential``
  containers: a GPT's transformer blocks, a ResNet's bottlenecks), then on the root, as its documentation
  wraps a model; every micro-batch's backward reduce-scatters (FSDP2's default, the same traffic as ZeRO-3's),
  the parameters resharded after each forward.

The systems alternate step by step (a shared machine's drifts hit them alike), each step between two barriers;
the median step and the spread (min..max) over the timed steps are printed, and the ratio of each one's
samples/s over FSDP2's (target >= 1.0). The first step's losses are compared (the same computation: they
agree to float32 rounding), and one more step of each is run under the allocation profiler for its peak
memory: the model state alive when it starts (each storage once: parameters' shards and buffers, gradients,
optimizer state; FSDP2's local shards) plus the most the step allocated above it, as the runtime measures a
CPU rank's peak (runtime/memory.py).

FSDP2's ``CPUOffloadPolicy`` (ZeRO-Infinity's host tier) is not compared here: on CPU ranks the host is the
device, so it would measure nothing but copies between the same memory.

Run: python benchmarks/runtime_vs_fsdp.py [--steps 30] [--quick]   (--quick: GPT only)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime_vs_ddp import CASES, arguments, batch, example, loss_fn, sgd  # noqa: E402
from runtime_vs_pipelining import spawned, timed_pair  # noqa: E402

from planner.plan import Plan  # noqa: E402

RANKS, SEED = 2, 0
System = tuple[Callable[[], float], Callable[[], int]]  # (one step, returning its mean loss; its profiled peak)


def sharded_plan(case: dict[str, Any]) -> Plan:
    from planner.manual import plan_with_split
    from planner.plan import OffloadSpec

    model, x = example(case)
    return plan_with_split(model, example_inputs=x, stage_starts=[], batch_size=case["batch"],
                           micro_batch_size=case["micro"], data_parallel=RANKS, schedule="1f1b", device="cpu",
                           optimizer="momentum", offload=[OffloadSpec(zero_stage=3)], builder=case["builder"],
                           builder_kwargs=case["kwargs"])


def fsdp_grouped(plan: Plan) -> Plan:
    """``plan`` gathering its parameters in FSDP2's groups here: one per block (:func:`blocks`), and the rest (the
    root's: embeddings, stem, heads) in one, gathered wherever a layer of it runs (the runtime cannot hold it
    across the blocks as FSDP2's root does: a few more collectives than FSDP2's)."""
    from runtime.build import rebuild_model

    offload = plan.stages[0].offload
    names = {name for group in offload.gathers for name in group}  # what the stage gathers by layer
    model = rebuild_model(plan)
    prefix = {id(module): name for name, module in model.named_modules()}
    per_block = [tuple(sorted(f"{prefix[id(block)]}.{name}" for name, _ in block.named_parameters()))
                 for block in blocks(model)]
    per_block = [group for group in per_block if set(group) <= names]
    rest = tuple(sorted(names - {name for group in per_block for name in group}))
    order = {name: index for index, name in enumerate(name for group in offload.gathers for name in group)}
    groups = sorted([*per_block, *([rest] if rest else [])], key=lambda group: min(order[name] for name in group))
    stage = dataclasses.replace(plan.stages[0], offload=dataclasses.replace(offload, gathers=tuple(groups)))
    return dataclasses.replace(plan, stages=(stage,))


def tessera_system(plan: Plan, case: dict[str, Any]) -> System:
    from runtime.build import rebuild_model
    from runtime.executor import Executor
    from runtime.microbatch import split_batch

    exe = Executor(plan, rebuild_model(plan), loss_fn, sgd, seed=SEED, timeout_s=120)
    inputs, target = batch(case)
    training = plan.training

    def profiled_peak() -> int:
        exe.run(split_batch(inputs, target, global_batch_size=training.global_batch_size,
                            data_parallel=plan.data_parallel, replica=exe.replica,
                            num_microbatches=training.num_microbatches), profile_memory=True)
        return exe.memory.peak_bytes
    return (lambda: exe.step(inputs, target)), profiled_peak


def blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the model's outermost containers (``nn.ModuleList``, ``nn.Sequential``) that hold
    parameters: a container inside a block (a bottleneck's downsample) is the block's."""
    found: list[nn.Module] = []
    inside: set[int] = set()  # the modules of blocks found so far
    for module in model.modules():  # (parents before their children)
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        for child in module.children():
            if next(child.parameters(), None) is not None:
                found.append(child)
                inside.update(id(descendant) for descendant in child.modules())
    return found


def fsdp_system(plan: Plan, case: dict[str, Any]) -> System:
    """The same model and weights under FSDP2, this replica's half of the batch in the same micro-batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from runtime.build import rebuild_model
    from runtime.weights import initialize

    model = initialize(rebuild_model(plan), SEED)
    mesh = init_device_mesh("cpu", (RANKS,))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = sgd(list(model.parameters()))
    inputs, target = batch(case)
    share = case["batch"] // RANKS
    rows = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)
    micro = list(zip(inputs[rows].split(case["micro"]), target[rows].split(case["micro"])))

    def step() -> float:
        total = torch.zeros(())
        for x, y in micro:
            loss = loss_fn(model(x), y) / len(micro)
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        return float(total) / RANKS

    def profiled_peak() -> int:
        from cost_models.allocations import allocated_peak_bytes, allocation_profiler
        from runtime.memory import storage_bytes

        state = [*model.parameters(), *model.buffers(),
                 *(value for per_param in optimizer.state.values() for value in per_param.values())]
        baseline = storage_bytes(_local(tensor) for tensor in state)
        with allocation_profiler() as profile:
            step()
        return baseline + allocated_peak_bytes(profile)
    return step, profiled_peak


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (the tensor itself otherwise)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor



def _rank(rank: int, init_file: str, name: str, plan_json: str, steps: int, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=300))
    plan, case = Plan.from_dict(json.loads(plan_json)), CASES[name]
    systems = {"tessera": tessera_system(plan, case), "same groups": tessera_system(fsdp_grouped(plan), case),
               "fsdp": fsdp_system(plan, case)}
    first_loss = {system: step() for system, (step, _) in systems.items()}  # (also a warm-up step each)
    times = timed_pair({system: step for system, (step, _) in systems.items()}, steps)
    peaks = {system: peak() for system, (_, peak) in systems.items()}
    gathered: list[Any] = [None] * RANKS
    dist.all_gather_object(gathered, peaks)
    if rank == 0:
        results.put({"times": times, "first_loss": first_loss,
                     "peak_bytes": {system: max(p[system] for p in gathered) for system in systems}})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    names, steps = arguments(__doc__.splitlines()[0])
    print(f"{RANKS} gloo processes, 1 thread each, parameters, gradients and optimizer state sharded over them; "
          f"{steps} timed steps per system, alternating; samples/s of the median step (min..max step ms) and "
          f"peak MiB of a profiled step (the higher rank's) of tessera in its plan's gather groups, tessera in "
          f"FSDP2's groups, and FSDP2; the largest difference of their first losses")
    print(f"{'model':<20} {'system':<22} {'groups':>6} {'samples/s':>10} {'(ms)':>14} {'/ FSDP2':>8} "
          f"{'peak MiB':>9} {'loss diff':>10}")
    for name in names:
        case = CASES[name]
        plan = sharded_plan(case)
        found = spawned(_rank, RANKS, name, plan.to_json(), steps)  # (seconds per step, first losses, peaks)
        times, first = found["times"], found["first_loss"]
        rates = {system: case["batch"] / statistics.median(values) for system, values in times.items()}
        groups = {"tessera": len(plan.stages[0].offload.gathers),
                  "same groups": len(fsdp_grouped(plan).stages[0].offload.gathers), "fsdp": len(blocks_of(plan)) + 1}
        labels = {"tessera": "tessera, its groups", "same groups": "tessera, FSDP2's groups", "fsdp": "FSDP2"}
        for system, values in times.items():
            spread = f"{min(values) * 1e3:.1f}..{max(values) * 1e3:.1f}"
            print(f"{name:<20} {labels[system]:<22} {groups[system]:>6} {rates[system]:>10.1f} {spread:>14} "
                  f"{rates[system] / rates['fsdp']:>7.3f}x {found['peak_bytes'][system] / 2**20:>9.2f} "
                  f"{abs(first[system] - first['fsdp']):>10.1e}")


def blocks_of(plan: Plan) -> list[nn.Module]:
    from runtime.build import rebuild_model

    return blocks(rebuild_model(plan))


if __name__ == "__main__":
    main()
