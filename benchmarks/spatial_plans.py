"""Where spatial tiles pay: predicted steps of tessera's plans with image tiles allowed and not.

For ResNet-1001, AmoebaNet-D and the U-Net at 512, 1024 and 2048 pixels on 16 x V100-16GB (global
batch 4, fp32, the GEMS scenario), the simulated step of:
  (tiles)    tessera's plan, stage 0 allowed on image tiles (``plan()``, the default);
  (pipeline) the best plan without tiles (``plan(..., spatial=False)``): pipeline x data parallel
             with recompute, swap and state offload, as now-dl's "pipeline parallelism" row;
  (layer)    layer parallelism: no tiles, one replica, the whole batch as one micro-batch (stages
             run one after another), now-dl's "layer parallelism" row;
and their ratios, against Hy-Fi's published claims (up to 2.67x over layer parallelism and 1.68x over
pipeline parallelism). A 224-pixel ResNet-50 (batch 64 on 8 GPUs) closes the table: tiles must not
be chosen there. "-" is a plan that does not fit.

Run: python benchmarks/spatial_plans.py [--quick]   (--quick: 512 and 1024 only)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.errors import PlanInfeasible  # noqa: E402
from cost_models.units import format_ms  # noqa: E402
from examples.models.amoebanet import amoebanet_d  # noqa: E402
from examples.models.resnet import resnet50, resnet1001  # noqa: E402
from examples.models.unet import unet  # noqa: E402
from planner import plan, trace  # noqa: E402
from planner.plan import Plan  # noqa: E402

MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "resnet1001": resnet1001,
    "amoebanet_d": amoebanet_d,
    "unet": unet,
}
HY_FI = {"layer": 2.67, "pipeline": 1.68}
"""Hy-Fi's published best speed-ups of spatial + pipeline parallelism over each baseline."""


def _plan(model: torch.nn.Module, graph, size: int, gpus: int, batch: int, **options) -> Plan | None:
    try:
        return plan(model, gpus, "16GB", batch_size=batch, graph=graph, device="V100-16GB", precision="fp32",
                    example_inputs=torch.empty(1, 3, size, size, device="meta"), time_limit_s=60, **options)
    except PlanInfeasible:
        return None


def _step(result: Plan | None) -> str:
    return "-" if result is None else format_ms(result.predicted.step_ms)


def _ratio(result: Plan | None, other: Plan | None) -> str:
    if result is None:
        return "-"
    if other is None:
        return "only tiles fit" if result.stages[0].spatial else "-"
    return f"{other.predicted.step_ms / result.predicted.step_ms:.2f}x"


def _row(name: str, size: int, model: torch.nn.Module, gpus: int, batch: int) -> None:
    start = time.perf_counter()
    graph = trace(model, torch.empty(1, 3, size, size, device="meta"))
    tiled = _plan(model, graph, size, gpus, batch)
    planned_s = time.perf_counter() - start
    pipeline = _plan(model, graph, size, gpus, batch, spatial=False)
    layer = _plan(model, graph, size, gpus, batch, spatial=False, data_parallel=(1,), micro_batch_sizes=(batch,))
    tiles = [] if tiled is None else [f"stage {stage.index}: {stage.spatial.describe()}" for stage in tiled.stages
                                      if stage.spatial is not None]
    chosen = "-" if tiled is None else "; ".join(tiles) or "no tiles"
    print(f"{name:<12} {size:>5} {_step(tiled):>10} {_step(pipeline):>10} {_step(layer):>10} "
          f"{_ratio(tiled, pipeline):>15} {_ratio(tiled, layer):>15} {planned_s:>8.1f}  {chosen}", flush=True)


def main() -> None:
    sizes = (512, 1024) if "--quick" in sys.argv else (512, 1024, 2048)
    print(f"16 x V100-16GB, batch 4, fp32; Hy-Fi's claims: {HY_FI['pipeline']}x over pipeline, "
          f"{HY_FI['layer']}x over layer parallelism")
    header = (f"{'model':<12} {'size':>5} {'tiles':>10} {'pipeline':>10} {'layer':>10} {'vs pipeline':>15} "
              f"{'vs layer':>15} {'plan (s)':>8}  spatial stages of the tiles plan")
    print(header)
    print("-" * len(header))
    for name, factory in MODELS.items():
        for size in sizes:
            _row(name, size, factory(), 16, 4)
    _row("resnet50", 224, resnet50(), 8, 64)


if __name__ == "__main__":
    main()
