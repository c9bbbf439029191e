"""Predicted step time of tessera's plan against two standard splits with the same layout.

Each model is planned with as many parts as GPUs (so there is a split to compare: a pipeline over all its
GPUs, or, for a family holding several parts per rank, "4/2r" four parts on two ranks per replica).
Baselines use the part count, ranks, data-parallel degree, micro-batching and schedule tessera chose:
  equal-layer       every stage gets the same number of graph nodes;
  param-balanced    every stage gets about the same parameter bytes (the default policy of
                    torch.distributed.pipelining's split_into_equal_size).
All three are costed by the same model and replayed by the same simulator.
Run: python benchmarks/plan_quality.py        (target: >= 1.3x on ResNet, AmoebaNet, U-Net)

Measured on CPU ranks (``--measured [--ranks 2 4] [--steps 12]``): small GPT and ResNet models
planned for this CPU (``device="cpu"``) run under tessera's runtime on gloo processes (one thread
each) against the plans a user would write by hand on the same ranks, every plan's executor built
in the same processes and the plans alternating step by step (so a shared machine's drifts hit all
alike); samples/s from the median step, its spread, and tessera's ratio to the better hand plan:
  pipeline     an equal-layer pipeline over all ranks, 1F1B, 2 x ranks micro-batches;
  DDP          one stage replicated on every rank (pure data parallelism), one micro-batch each.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_vs_pipelining import spawned  # noqa: E402

from examples.models.amoebanet import amoebanet_d  # noqa: E402
from examples.models.bert import bert_large  # noqa: E402
from examples.models.resnet import resnet152  # noqa: E402
from examples.models.unet import unet  # noqa: E402
from planner import LayerGraph, NodeKind, plan, trace  # noqa: E402
from planner.manual import plan_with_split  # noqa: E402
from planner.plan import Plan, ScheduleKind, StateTier  # noqa: E402

# name: (model factory, one input sample, global batch, GPUs, device, memory per GPU)
CASES: dict[str, tuple[Callable[[], torch.nn.Module], torch.Tensor, int, int, str, str]] = {
    "resnet152": (resnet152, torch.empty(1, 3, 224, 224, device="meta"), 64, 4, "V100-16GB", "16GB"),
    "amoebanet_d_18_256": (amoebanet_d, torch.empty(1, 3, 224, 224, device="meta"), 64, 4, "V100-16GB", "16GB"),
    "resnet152_1024": (resnet152, torch.empty(1, 3, 1024, 1024, device="meta"), 8, 4, "V100-32GB", "32GB"),
    "amoebanet_d_6_256_512": (lambda: amoebanet_d(num_layers=6), torch.empty(1, 3, 512, 512, device="meta"),
                              16, 4, "V100-32GB", "32GB"),
    "unet_1024": (unet, torch.empty(1, 3, 1024, 1024, device="meta"), 8, 4, "V100-32GB", "32GB"),
    "bert_large": (bert_large, torch.empty(1, 512, dtype=torch.long, device="meta"), 64, 4, "V100-16GB", "16GB"),
}


def compute_nodes(graph: LayerGraph) -> list[str]:
    return [n.name for n in graph if n.kind not in (NodeKind.INPUT, NodeKind.PARAM, NodeKind.OUTPUT)]


def equal_layer_starts(graph: LayerGraph, stages: int) -> list[str]:
    nodes = compute_nodes(graph)
    return [nodes[len(nodes) * s // stages] for s in range(1, stages)]


def param_balanced_starts(graph: LayerGraph, stages: int) -> list[str]:
    nodes = compute_nodes(graph)
    owned = graph.owned_param_bytes
    total = sum(owned[n] for n in nodes)
    starts, running = [], 0
    for index, name in enumerate(nodes[:-1]):
        running += owned[name]
        if len(starts) < stages - 1 and running >= total * (len(starts) + 1) / stages:
            starts.append(nodes[index + 1])
    while len(starts) < stages - 1:  # degenerate: parameters all at the end
        starts.append(nodes[len(nodes) - stages + len(starts) + 1])
    return sorted(set(starts), key=nodes.index)


# name: (builder, its arguments, one input sample as the command line writes it, global batch)
MEASURED: dict[str, tuple[str, dict[str, Any], str, int]] = {
    "gpt": ("examples/models/gpt.py:gpt", {"hidden": 128, "layers": 4, "heads": 4, "seq_len": 64,
                                            "vocab": 4096, "dropout": 0.0}, "64:int64", 16),
    "resnet50": ("examples/models/resnet.py:resnet50", {"width": 8, "num_classes": 10}, "3x64x64", 16),
}
SEED = 0


def measured_plans(name: str, ranks: int) -> dict[str, Plan]:
    """tessera's plan of MEASURED[name] on ``ranks`` CPU processes and the two hand-written ones."""
    from cost_models.graph.model_spec import build_model, example_inputs, load_builder, parse_input

    builder, kwargs, sample, batch = MEASURED[name]
    model = build_model(load_builder(builder, Path.cwd()), kwargs, "cpu")  # real weights: plans from measured times
    x = example_inputs([parse_input(sample)], 1, "meta")
    graph = trace(model, x)
    common = {"example_inputs": x, "graph": graph, "device": "cpu", "optimizer": "momentum",
              "builder": builder, "builder_kwargs": kwargs, "batch_size": batch}
    micro = max(1, batch // (2 * ranks))
    return {"tessera": plan(model, gpus=ranks, mem="4GB", **common),
            "pipeline": plan_with_split(model, stage_starts=equal_layer_starts(graph, ranks),
                                        micro_batch_size=micro, schedule="1f1b", **common),
            "DDP": plan_with_split(model, stage_starts=[], micro_batch_size=batch // ranks,
                                   data_parallel=ranks, schedule="gpipe", **common)}


def _measure_rank(rank: int, init_file: str, world: int, plans_json: dict[str, str], steps: int,
                  results: Any) -> None:
    import json

    from runtime.build import rebuild_model
    from runtime.data import SyntheticData, input_specs, synthetic_task
    from runtime.executor import Executor
    from runtime.optim import optimizer_factory

    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    runs: dict[str, Callable[[int], float]] = {}
    for name, text in plans_json.items():
        chosen = Plan.from_dict(json.loads(text))
        executor = Executor(chosen, rebuild_model(chosen, Path.cwd()), lambda out, target: out.sum(),
                            optimizer_factory(chosen.training.optimizer, None), seed=SEED, timeout_s=600)
        output = executor.flow.specs[executor.flow.output_names[0]]
        data = SyntheticData(input_specs(executor.traced, dict(executor.flow.specs)), synthetic_task(output), SEED)
        executor.loss_fn = data.task
        count = chosen.training.num_microbatches

        def step(index: int, executor: Executor = executor, data: SyntheticData = data, count: int = count) -> float:
            batches = [data.microbatch(index, executor.replica * count + m, inputs=executor.needs_inputs,
                                       targets=executor.needs_targets) for m in range(count)]
            return executor.run(batches)
        runs[name] = step
    times: dict[str, list[float]] = {name: [] for name in runs}
    warmup = 2
    for index in range(warmup + steps):
        for name, step in runs.items():
            dist.barrier()
            began = time.perf_counter()
            step(index)
            dist.barrier()
            if index >= warmup:
                times[name].append(time.perf_counter() - began)
    if rank == 0:
        results.put(times)
    dist.barrier()
    dist.destroy_process_group()


def measure(plans: dict[str, Plan], steps: int) -> dict[str, list[float]]:
    """Seconds per step of each plan, measured alternating in one set of gloo processes."""
    world = next(iter(plans.values())).cluster.gpus
    times = spawned(_measure_rank, world, world, {name: p.to_json() for name, p in plans.items()}, steps)
    return times


def describe_layout(chosen: Plan) -> str:
    offload = chosen.stages[0].offload
    state = f" zero{offload.zero_stage}" if offload.zero_stage else ""
    state += f" opt:{offload.optimizer_state.value}" if offload.optimizer_state is not StateTier.GPU else ""
    return (f"{chosen.num_stages}x{chosen.data_parallel} mb {chosen.training.micro_batch_size} "
            f"{chosen.schedule.kind.value}{state}")


def main_measured(ranks: list[int], steps: int) -> None:
    import os

    print(f"measured on CPU: gloo processes x 1 thread, median of {steps} steps per plan, the plans "
          f"alternating step by step; load average {os.getloadavg()[0]:.1f} at the start")
    print(f"{'model':<10} {'ranks':>5}  {'plan':<9} {'layout':<26} {'predicted':>10} {'samples/s':>10} "
          f"{'spread':>14} {'tessera / it':>12}")
    for name in MEASURED:
        for world in ranks:
            plans = measured_plans(name, world)
            times = measure(plans, steps)
            batch = MEASURED[name][3]
            rate = {key: batch / statistics.median(values) for key, values in times.items()}
            for key, chosen in plans.items():
                spread = f"{batch / max(times[key]):.1f}-{batch / min(times[key]):.1f}"
                ratio = "" if key == "tessera" else f"{rate['tessera'] / rate[key]:.2f}x"
                print(f"{name:<10} {world:>5}  {key:<9} {describe_layout(chosen):<26} "
                      f"{chosen.predicted.step_ms:>8.1f}ms {rate[key]:>10.1f} {spread:>14} {ratio:>12}")
            best_hand = max(rate["pipeline"], rate["DDP"])
            print(f"{name:<10} {world:>5}  tessera / better hand plan: {rate['tessera'] / best_hand:.2f}x")


def main(names: list[str]) -> None:
    print(f"{'model':<20} {'layout':<28} {'tessera ms':>10} {'equal-layer ms':>15} {'ratio':>6} "
          f"{'param-bal. ms':>14} {'ratio':>6}")
    for name in names or list(CASES):
        factory, x, batch, gpus, device, mem = CASES[name]
        model = factory()
        graph = trace(model, x)
        best = plan(model, gpus=gpus, mem=mem, batch_size=batch, example_inputs=x, device=device,
                    graph=graph, num_stages=(gpus,))
        ranks = best.cluster.gpus // best.data_parallel  # of a replica's pipeline
        per_rank, interleaved = best.num_parts // ranks, best.schedule.kind is ScheduleKind.INTERLEAVED_1F1B
        layout = (f"{best.num_stages}{f'/{ranks}r' if per_rank > 1 else ''}x{best.data_parallel} "
                  f"mb {best.training.micro_batch_size} {best.schedule.kind.value}")
        row = [f"{name:<20} {layout:<28} {best.predicted.step_ms:>10.1f}"]
        for policy in (equal_layer_starts, param_balanced_starts):
            if best.num_stages == 1:
                row.append(f"{'(1 stage)':>15} {'-':>6}")
                continue
            baseline = plan_with_split(model, example_inputs=x, graph=graph, device=device, mem=mem,
                                       stage_starts=policy(graph, best.num_stages), batch_size=batch,
                                       micro_batch_size=best.training.micro_batch_size,
                                       data_parallel=best.data_parallel, schedule=best.schedule.kind.value,
                                       virtual_stages=per_rank if interleaved else None)
            assert baseline.cluster.gpus == best.cluster.gpus, (baseline.cluster.gpus, best.cluster.gpus)
            peak = max(baseline.predicted.peak_mem_bytes)
            over = " OOM" if peak > best.cluster.mem_bytes else ""
            ratio = baseline.predicted.step_ms / best.predicted.step_ms
            row.append(f"{baseline.predicted.step_ms:>15.1f} {ratio:>5.2f}x{over}")
        print(" ".join(row))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"predicted cases (default all: {', '.join(CASES)})")
    parser.add_argument("--measured", action="store_true", help="measure on CPU ranks instead")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=12)
    arguments = parser.parse_args()
    if arguments.measured:
        main_measured(arguments.ranks, arguments.steps)
    else:
        main(arguments.names)
