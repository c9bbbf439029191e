"""On one CUDA GPU: tessera's runtime against the plain PyTorch loop a user would write, per saved plan.

For each one-stage, one-GPU plan (``tessera plan ... --gpus 1 -o PLAN``, e.g. with ``--device`` a
``tessera calibrate --device cuda`` file), both systems train the same model (``runtime.initialize``'s
weights) on the same synthetic micro-batches (runtime/data.py, the data ``tessera run`` draws), with
the plan's optimizer and loss:

* tessera: the Executor runs the plan (its micro-batches, recompute regions, precision: a 16-bit
  plan computes on a 16-bit copy of fp32 master weights);
* eager: the model on the GPU, each micro-batch's loss scaled by 1/M and backpropagated, then the
  optimizer step (a 16-bit plan's baseline runs under ``torch.autocast`` in that dtype, as a
  user would), nothing recomputed.

The systems alternate step by step, the GPU synchronised around each step; the plan's predicted
step, each system's median step and spread (min..max), and tessera's samples/s over eager's are
printed. The predicted peak memory is checked against the allocator by ``tessera run`` +
``tessera validate`` (one process per run), not here, where both systems share one allocator.

With ``--breakdown N``, each system's step is then profiled (torch.profiler, two steps): the GPU's busy
time per step (the rest of the step the GPU waited on the host) and the N operators with the most GPU time.

Run (CUDA only): python benchmarks/one_gpu.py PLAN [PLAN ...] [--steps 30] [--breakdown 12]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.plan import Plan  # noqa: E402
from runtime.build import rebuild_model  # noqa: E402
from runtime.data import SyntheticData, input_specs, synthetic_task  # noqa: E402
from runtime.executor import Executor  # noqa: E402
from runtime.microbatch import Microbatch  # noqa: E402
from runtime.optim import optimizer_factory  # noqa: E402
from runtime.precision import compute_dtype  # noqa: E402
from runtime.weights import initialize  # noqa: E402

SEED = 0


def tessera_step(plan: Plan, device: torch.device) -> tuple[Callable[[], None], SyntheticData]:
    exe = Executor(plan, rebuild_model(plan), lambda output, target: output,
                   optimizer_factory(plan.training.optimizer), seed=SEED, device=device, timeout_s=300)
    output = exe.flow.specs[exe.flow.output_names[0]]
    data = SyntheticData(input_specs(exe.traced, dict(exe.flow.specs)), synthetic_task(output), SEED)
    exe.loss_fn = data.task
    micro = [data.microbatch(0, index) for index in range(plan.training.num_microbatches)]
    return lambda: exe.run(micro), data


def eager_step(plan: Plan, data: SyntheticData, device: torch.device) -> Callable[[], None]:
    """The user's loop: the whole model on the GPU, the same micro-batches, autocast for a 16-bit plan."""
    model = initialize(rebuild_model(plan), SEED, device=device)
    optimizer = optimizer_factory(plan.training.optimizer)(list(model.parameters()))
    dtype = compute_dtype(plan.model.precision)
    autocast = (torch.autocast("cuda", dtype=dtype) if dtype in (torch.float16, torch.bfloat16)
                else contextlib.nullcontext())
    count = plan.training.num_microbatches
    micro: list[Microbatch] = [data.microbatch(0, index) for index in range(count)]

    def step() -> None:
        for batch in micro:
            assert batch.inputs is not None and batch.targets is not None
            inputs = [x.to(device, non_blocking=True) for x in batch.inputs]
            with autocast:
                loss = data.task(model(*inputs), batch.targets.to(device, non_blocking=True)) / count
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def timed(steps: dict[str, Callable[[], None]], count: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per step of each system, alternating step by step, the GPU synchronised around each."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(warmup + count):
        for name, step in steps.items():
            torch.cuda.synchronize()
            began = time.perf_counter()
            step()
            torch.cuda.synchronize()
            if index >= warmup:
                times[name].append(time.perf_counter() - began)
    return times


def breakdown(steps: dict[str, Callable[[], None]], rows: int) -> None:
    """Per system: GPU busy ms per step and the ``rows`` operators with the most GPU time (two steps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        kernels = [event for event in prof.events() if event.device_type == DeviceType.CUDA]  # not the ops too
        busy_ms = sum(event.self_device_time_total for event in kernels) / 2 / 1e3
        events = prof.key_averages()
        print(f"  {name}: GPU busy {busy_ms:.1f} ms per step; operators by GPU time over two steps:")
        table = events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=48)
        print("\n".join("    " + line for line in table.splitlines()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per system (after 2 warm-up steps)")
    parser.add_argument("--breakdown", type=int, default=0, metavar="ROWS",
                        help="then profile each system's step and print its top ROWS operators by GPU time")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"one_gpu.py runs on a CUDA GPU; torch {torch.__version__} sees none here")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as scratch:
        dist.init_process_group("nccl", init_method=f"file://{scratch}/rendezvous", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=300), device_id=device)
        print(f"{torch.cuda.get_device_name(device)}; {args.steps} timed steps per system, alternating; "
              f"median step ms (min..max)")
        print(f"{'plan':<28} {'predicted':>10} {'tessera':>22} {'eager':>22} {'tessera / eager':>16}")
        for path in args.plans:
            plan = Plan.load(path)
            if plan.layout.world_size != 1:
                sys.exit(f"{path} is a plan for {plan.layout.world_size} GPUs; one_gpu.py compares one-GPU plans")
            tessera, data = tessera_step(plan, device)
            systems = {"tessera": tessera, "eager": eager_step(plan, data, device)}
            times = timed(systems, args.steps)
            median = {name: statistics.median(values) for name, values in times.items()}
            spread = {name: f"{median[name] * 1e3:.1f} ({min(v) * 1e3:.1f}..{max(v) * 1e3:.1f})"
                      for name, v in times.items()}
            print(f"{path.name:<28} {plan.predicted.step_ms:>10.1f} {spread['tessera']:>22} "
                  f"{spread['eager']:>22} {median['eager'] / median['tessera']:>15.3f}x")
            if args.breakdown:
                breakdown(systems, args.breakdown)
            del tessera, systems, times
            torch.cuda.empty_cache()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
