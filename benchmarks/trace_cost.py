"""Wall time and peak resident memory of trace()+estimate() for full-size zoo models on meta.

Each model runs in a fresh subprocess so its resident-memory peak is its own. Run:
    python benchmarks/trace_cost.py [gpt_50b resnet1001_1024 ...]
Targets (issue 2): the 50B GPT and ResNet-1001 at 1024x1024 each under 30 s and 2 GiB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from case_names import case_names

ROOT = Path(__file__).resolve().parents[1]

MODELS = {
    # name: (builder spec, builder kwargs, input shape with batch, input dtype)
    "gpt_50b": ("examples.models.gpt:gpt_50b", {}, (1, 1024), "int64"),
    "resnet1001_1024": ("examples.models.resnet:resnet1001", {}, (1, 3, 1024, 1024), "float32"),
    "resnet50_224": ("examples.models.resnet:resnet50", {}, (32, 3, 224, 224), "float32"),
    "bert_large": ("examples.models.bert:bert_large", {}, (8, 512), "int64"),
    "amoebanet_d_18_256": ("examples.models.amoebanet:amoebanet_d", {}, (8, 3, 224, 224), "float32"),
    "unet_2048": ("examples.models.unet:unet", {}, (1, 3, 2048, 2048), "float32"),
    "vgg16_224": ("examples.models.vgg:vgg16", {}, (32, 3, 224, 224), "float32"),
    "wrn_28_10": ("examples.models.wrn:wrn_28_10", {}, (128, 3, 32, 32), "float32"),
}

_CHILD = """
import json, resource, sys, time
start = time.perf_counter()
import torch
from cost_models import estimate
from planner import trace
from cost_models.graph.model_spec import build_model, load_builder
spec, kwargs, shape, dtype = json.loads(sys.argv[1])
model = build_model(load_builder(spec), kwargs, "meta")
graph = trace(model, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
table = estimate(graph, "V100-32GB")
print(json.dumps({"wall_s": time.perf_counter() - start, "nodes": len(graph),
                  "params": graph.param_count, "fwd_tflop": table.total("fwd_flops") / 1e12,
                  "saved_gib": table.total("saved_activation_bytes") / 2**30,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(name: str) -> dict[str, float]:
    spec, kwargs, shape, dtype = MODELS[name]
    result = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([spec, kwargs, shape, dtype])],
                            cwd=ROOT, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(names: list[str]) -> None:
    print(f"{'model':<20} {'nodes':>6} {'params':>10} {'fwd TFLOP':>10} {'saved GiB':>10} "
          f"{'wall s':>7} {'peak RSS MiB':>13}")
    for name in names or list(MODELS):
        row = measure(name)
        print(f"{name:<20} {row['nodes']:>6} {row['params'] / 1e6:>9.1f}M {row['fwd_tflop']:>10.2f} "
              f"{row['saved_gib']:>10.2f} {row['wall_s']:>7.1f} {row['peak_rss_mib']:>13.0f}")


if __name__ == "__main__":
    main(case_names(__doc__.splitlines()[0], MODELS))
