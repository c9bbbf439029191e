"""Predicted step time of tessera's plan against two standard splits with the same layout.

Each model is planned as a pure pipeline over all its GPUs (so there is a split to compare).
Baselines use the stage count, data-parallel degree, micro-batching and schedule tessera chose:
  equal-layer       every stage gets the same number of graph nodes;
  param-balanced    every stage gets about the same parameter bytes (the default policy of
                    torch.distributed.pipelining's split_into_equal_size).
All three are costed by the same model and replayed by the same simulator.
Run: python benchmarks/plan_quality.py        (target: >= 1.3x on ResNet, AmoebaNet, U-Net)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models.amoebanet import amoebanet_d  # noqa: E402
from examples.models.bert import bert_large  # noqa: E402
from examples.models.resnet import resnet152  # noqa: E402
from examples.models.unet import unet  # noqa: E402
from planner import LayerGraph, NodeKind, plan, trace  # noqa: E402
from planner.manual import plan_with_split  # noqa: E402
from cost_models.units import format_bytes  # noqa: E402

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


def main(names: list[str]) -> None:
    print(f"{'model':<20} {'layout':<28} {'tessera ms':>10} {'equal-layer ms':>15} {'ratio':>6} "
          f"{'param-bal. ms':>14} {'ratio':>6}")
    for name in names or list(CASES):
        factory, x, batch, gpus, device, mem = CASES[name]
        model = factory()
        graph = trace(model, x)
        best = plan(model, gpus=gpus, mem=mem, batch_size=batch, example_inputs=x, device=device,
                    graph=graph, num_stages=(gpus,))
        layout = (f"{best.num_stages}x{best.data_parallel} mb {best.training.micro_batch_size} "
                  f"{best.schedule.kind.value}")
        row = [f"{name:<20} {layout:<28} {best.predicted.step_ms:>10.1f}"]
        for policy in (equal_layer_starts, param_balanced_starts):
            if best.num_stages == 1:
                row.append(f"{'(1 stage)':>15} {'-':>6}")
                continue
            baseline = plan_with_split(model, example_inputs=x, graph=graph, device=device, mem=mem,
                                       stage_starts=policy(graph, best.num_stages), batch_size=batch,
                                       micro_batch_size=best.training.micro_batch_size,
                                       data_parallel=best.data_parallel, schedule=best.schedule.kind.value)
            peak = max(baseline.predicted.peak_mem_bytes)
            over = " OOM" if peak > best.cluster.mem_bytes else ""
            ratio = baseline.predicted.step_ms / best.predicted.step_ms
            row.append(f"{baseline.predicted.step_ms:>15.1f} {ratio:>5.2f}x{over}")
        print(" ".join(row))


if __name__ == "__main__":
    main(sys.argv[1:])
