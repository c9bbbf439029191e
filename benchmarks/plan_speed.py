"""Wall time of planning full-size models on 16 GPUs: tracing + costing, and the whole search.

Run: python benchmarks/plan_speed.py [name ...]     (target: under 10 s each on a 2-core CPU)
Compare on an idle machine: a second process planning beside it doubles every time.
Each model is planned in a fresh process so timings do not share caches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from case_names import case_names

ROOT = Path(__file__).resolve().parents[1]

# name: (builder, input shape per sample, input dtype, global batch, device, memory per GPU)
CASES = {
    "gems_resnet1001_1024": ("examples.models.resnet:resnet1001", (3, 1024, 1024), "float32", 4,
                             "V100-16GB", "16GB"),  # the GEMS scenario (issue 11): only image tiles fit
    "resnet1001_1024": ("examples.models.resnet:resnet1001", (3, 1024, 1024), "float32", 16,
                        "A100-80GB", "80GB"),
    "gpt_50b": ("examples.models.gpt:gpt_50b", (1024,), "int64", 4, "A100-80GB", "80GB"),
    "zero_infinity_gpt_50b": ("examples.models.gpt:gpt_50b", (1024,), "int64", 64, "V100-32GB",
                              "32GB"),  # ZeRO-Infinity's scenario: only offloaded plans fit
    "bert_large": ("examples.models.bert:bert_large", (512,), "int64", 256, "V100-16GB", "16GB"),
    "amoebanet_d_18_256": ("examples.models.amoebanet:amoebanet_d", (3, 224, 224), "float32", 256,
                           "V100-16GB", "16GB"),
}

_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
from planner import plan, trace
from cost_models.graph.model_spec import build_model, load_builder
builder, shape, dtype, batch, device, mem = json.loads(sys.argv[1])
model = build_model(load_builder(builder), {}, "meta")
x = torch.empty((1, *shape), dtype=getattr(torch, dtype), device="meta")
graph = trace(model, x)
traced = time.perf_counter()
result = plan(model, gpus=16, mem=mem, batch_size=batch, example_inputs=x, device=device, graph=graph)
done = time.perf_counter()
print(json.dumps({"trace_s": traced - start, "search_s": done - traced, "total_s": done - start,
                  "nodes": len(graph), "configs": result.solver.configs_tried,
                  "layout": f"{result.num_stages}x{result.data_parallel} {result.schedule.kind.value}",
                  "step_ms": result.predicted.step_ms}))
"""


def measure(name: str) -> dict:
    completed = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(CASES[name])], cwd=ROOT,
                               capture_output=True, text=True, timeout=900)
    if completed.returncode:
        raise RuntimeError(f"{name} failed:\n{completed.stderr[-2000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main(names: list[str]) -> None:
    print(f"{'model (16 GPUs)':<22} {'nodes':>6} {'trace+cost s':>13} {'search s':>9} {'total s':>8} "
          f"{'configs':>8}  plan")
    for name in names or list(CASES):
        row = measure(name)
        print(f"{name:<22} {row['nodes']:>6} {row['trace_s']:>13.1f} {row['search_s']:>9.1f} "
              f"{row['total_s']:>8.1f} {row['configs']:>8}  {row['layout']}, step {row['step_ms']:.0f} ms")


if __name__ == "__main__":
    main(case_names(__doc__.splitlines()[0], CASES))
