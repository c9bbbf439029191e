"""Halo traffic and time of a tiled 2048x2048 stem on 4 CPU processes: per-layer halos against one fused halo.

Run: python benchmarks/spatial_halo.py [--size 2048] [--repeats 5]

For each slicing it prints, per conv/pool layer, the halo bytes and messages the ranks sent
(counted by the runtime, next to cost_models.halo's prediction), then the median forward+backward
time of one step with per-layer halos and with one fused halo for the whole stem (slowest rank),
and of the unpartitioned stem on one process. The 4 processes share this machine's cores, so the
times compare the two halo designs with each other, not with a cluster.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.halo import halo_cost
from cost_models.presets import PRESETS
from runtime.spatial import (
    FusedHaloBlock,
    TileGrid,
    allreduce_replicated_grads,
    count_messages,
    output_grid,
    spatialize,
)
from runtime.spatial.layers import SpatialWindowLayer
from tests.dist.harness import run_ranks

RANKS = 4
SLICINGS = ("square", "vertical")


def stem() -> nn.Sequential:
    """A small-channel ResNet-style stem: 7x7/2 conv 3->8, BN, ReLU, 3x3/2 max pool, two 3x3 conv blocks."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
    )


def _median_step_ms(module: nn.Module, tile: torch.Tensor, grad: torch.Tensor, repeats: int,
                    reduce_grads: bool) -> float:
    def once() -> float:
        module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        module(tile).backward(grad)
        if reduce_grads:
            allreduce_replicated_grads(module, None)
        return (time.perf_counter() - start) * 1e3
    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def _record_input_channels(tiled: nn.Module) -> dict[str, int]:
    """Input channels of each tiled layer, filled in by a hook on the first forward pass."""
    channels: dict[str, int] = {}

    def hook(name: str) -> Any:
        return lambda _module, args: channels.update({name: args[0].shape[1]})  # returns None: input unchanged

    for name, layer in tiled.named_modules():
        if isinstance(layer, SpatialWindowLayer):
            layer.register_forward_pre_hook(hook(name))
    return channels


def _layer_rows(tiled: nn.Module, rank: int, steps: int, in_channels: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    link = PRESETS["V100-16GB"].intra_node
    for name, layer in tiled.named_modules():
        if isinstance(layer, SpatialWindowLayer):
            channels = in_channels[name]
            predicted = halo_cost(layer.spec.geometry(), layer.input_grid, rank, channels=channels, dtype_bytes=4,
                                  batch=1, link=link)
            counter = layer.exchange.counter
            rows.append({"layer": f"{name} {layer.spec.kind.value} k{layer.spec.rows.kernel}/s{layer.spec.rows.stride}",
                         "messages": counter.forward_messages // steps, "bytes": counter.forward_bytes // steps,
                         "predicted_bytes": predicted.bytes_sent})
    return rows


def measure(rank: int, world_size: int, slicing: str, size: int, repeats: int) -> dict[str, Any]:
    """One rank: per-layer halo counts, then step times for per-layer and fused halos."""
    model = stem()
    x = torch.randn(1, 3, size, size)
    grid = TileGrid.build(world_size, slicing, size, size)
    out_grid = output_grid(model, grid)
    grad = out_grid.tile(torch.randn(1, 8, out_grid.height, out_grid.width), rank)
    tile = grid.tile(x, rank).contiguous()
    per_layer = spatialize(model, grid, None)
    in_channels = _record_input_channels(per_layer)
    fused = FusedHaloBlock(stem(), grid, None)
    per_layer_ms = _median_step_ms(per_layer, tile, grad, repeats, True)
    fused_ms = _median_step_ms(fused, tile, grad, repeats, True)
    steps = repeats + 1
    return {"layers": _layer_rows(per_layer, rank, steps, in_channels), "per_layer_ms": per_layer_ms, "fused_ms": fused_ms,
            "fused_messages": count_messages(fused).forward_messages // steps,
            "fused_bytes": count_messages(fused).forward_bytes // steps}


def single_process_ms(size: int, repeats: int) -> float:
    torch.set_num_threads(1)
    model = stem()
    x = torch.randn(1, 3, size, size)
    out = model(x)
    return _median_step_ms(model, x, torch.randn_like(out), repeats, False)


def report(slicing: str, results: list[dict[str, Any]]) -> None:
    print(f"\n{slicing} slicing, {RANKS} ranks: halo per forward step, summed over ranks")
    print(f"{'layer':<28} {'messages':>8} {'bytes':>12} {'predicted':>12}")
    for index, row in enumerate(results[0]["layers"]):
        messages = sum(r["layers"][index]["messages"] for r in results)
        sent = sum(r["layers"][index]["bytes"] for r in results)
        predicted = sum(r["layers"][index]["predicted_bytes"] for r in results)
        print(f"{row['layer']:<28} {messages:>8} {sent:>12,} {predicted:>12,}")
    total_messages = sum(sum(row["messages"] for row in r["layers"]) for r in results)
    total_bytes = sum(sum(row["bytes"] for row in r["layers"]) for r in results)
    print(f"{'per-layer total':<28} {total_messages:>8} {total_bytes:>12,}")
    print(f"{'fused (one wide halo)':<28} {sum(r['fused_messages'] for r in results):>8} "
          f"{sum(r['fused_bytes'] for r in results):>12,}")
    print(f"step ms (fwd+bwd+grad all-reduce, median, slowest rank): per-layer "
          f"{max(r['per_layer_ms'] for r in results):.0f}, fused {max(r['fused_ms'] for r in results):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for slicing in SLICINGS:
        report(slicing, run_ranks(measure, RANKS, slicing, args.size, args.repeats, timeout_s=550))
    print(f"\nunpartitioned stem, 1 process: {single_process_ms(args.size, args.repeats):.0f} ms per step")


if __name__ == "__main__":
    main()
