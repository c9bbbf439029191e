"""Plans of the zoo models through the public API, as a table (and JSON) to compare across changes.

Run: python benchmarks/zoo_plans.py [--json plans.json] [--compare old.json] [name ...]

Each row is one `plan()` call on the meta device: the layout, schedule and micro-batching chosen,
where every stage starts, the simulated step and the solver's objective; a budget nothing fits
shows the smallest memory the error names. `--compare` prints, per case, whether the stages
and steps equal those of an earlier run (to 1e-9 relative), so a refactor can show that it
changed no decision.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner import plan  # noqa: E402
from cost_models.errors import PlanInfeasible  # noqa: E402
from cost_models.graph.model_spec import build_model, load_builder  # noqa: E402

# name: (builder, builder kwargs, input shape per sample, dtype, global batch, GPUs, device, memory)
CASES: dict[str, tuple[str, dict[str, Any], tuple[int, ...], str, int, int, str, str]] = {
    "resnet152_16gpu": ("examples.models.resnet:resnet152", {}, (3, 224, 224), "float32", 256, 16,
                        "V100-16GB", "16GB"),
    "resnet50_tight": ("examples.models.resnet:resnet50", {}, (3, 224, 224), "float32", 256, 8,
                       "V100-16GB", "2GB"),
    "gpt2_medium_4gb": ("examples.models.gpt:gpt2_medium", {}, (1024,), "int64", 32, 8, "V100-32GB", "4GB"),
    "gpt2_medium_6gb": ("examples.models.gpt:gpt2_medium", {}, (1024,), "int64", 32, 8, "V100-32GB", "6GB"),
    "megatron_8_3b": ("examples.models.gpt:megatron_8_3b", {}, (1024,), "int64", 16, 16, "A100-80GB",
                      "80GB"),
    "bert_large": ("examples.models.bert:bert_large", {}, (512,), "int64", 256, 16, "V100-16GB", "16GB"),
    "amoebanet_d_18_256": ("examples.models.amoebanet:amoebanet_d", {}, (3, 224, 224), "float32", 256, 16,
                           "V100-16GB", "16GB"),
    "unet_512": ("examples.models.unet:unet", {}, (3, 512, 512), "float32", 16, 8, "V100-16GB", "16GB"),
    "vgg16": ("examples.models.vgg:vgg16", {}, (3, 224, 224), "float32", 128, 4, "V100-16GB", "16GB"),
    "wrn_28_10": ("examples.models.wrn:wrn_28_10", {}, (3, 32, 32), "float32", 512, 4, "V100-16GB", "4GB"),
    "resnet1001_1024_a100": ("examples.models.resnet:resnet1001", {}, (3, 1024, 1024), "float32", 16, 16,
                             "A100-80GB", "80GB"),
    "gpt_50b_a100": ("examples.models.gpt:gpt_50b", {}, (1024,), "int64", 4, 16, "A100-80GB", "80GB"),
    "resnet1001_1024_v100": ("examples.models.resnet:resnet1001", {}, (3, 1024, 1024), "float32", 4, 16,
                             "V100-16GB", "16GB"),
    "gpt_50b_v100": ("examples.models.gpt:gpt_50b", {}, (1024,), "int64", 64, 16, "V100-32GB", "32GB"),
}


def run_case(name: str) -> dict[str, Any]:
    builder, kwargs, shape, dtype, batch, gpus, device, mem = CASES[name]
    model = build_model(load_builder(builder), kwargs, "meta")
    x = torch.empty((1, *shape), dtype=getattr(torch, dtype), device="meta")
    start = time.perf_counter()
    try:
        result = plan(model, gpus=gpus, mem=mem, batch_size=batch, example_inputs=x, device=device)
    except PlanInfeasible as error:
        return {"infeasible": True, "min_mem_bytes": error.min_mem_bytes,
                "wall_s": time.perf_counter() - start}
    return {"infeasible": False, "wall_s": time.perf_counter() - start,
            "layout": f"{result.num_stages}x{result.data_parallel}",
            "schedule": result.schedule.kind.value,
            "micro": f"{result.training.num_microbatches}x{result.training.micro_batch_size}",
            "stage_starts": [stage.nodes[0] for stage in result.stages],
            "step_ms": result.predicted.step_ms, "objective_ms": result.solver.objective,
            "peak_mem_bytes": list(result.predicted.peak_mem_bytes)}


def same(old: dict[str, Any], new: dict[str, Any]) -> bool:
    if old["infeasible"] or new["infeasible"]:
        return old["infeasible"] == new["infeasible"] and old.get("min_mem_bytes") == new.get("min_mem_bytes")
    close = all(abs(old[key] - new[key]) <= 1e-9 * abs(old[key]) for key in ("step_ms", "objective_ms"))
    return close and all(old[key] == new[key] for key in ("layout", "schedule", "micro", "stage_starts"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(CASES))
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--compare", type=Path, default=None, help="rows of an earlier run")
    args = parser.parse_args()
    earlier = json.loads(args.compare.read_text()) if args.compare else {}
    rows = {}
    print(f"{'case':<22} {'plan':<32} {'step ms':>14} {'objective ms':>14} {'plan s':>7}  same")
    for name in args.names:
        row = rows[name] = run_case(name)
        if row["infeasible"]:
            text, step, objective = f"infeasible: needs {row['min_mem_bytes'] / 2**30:.2f} GiB", "", ""
        else:
            text = f"{row['layout']} {row['schedule']} {row['micro']}"
            step, objective = f"{row['step_ms']:.6f}", f"{row['objective_ms']:.6f}"
        verdict = ("yes" if same(earlier[name], row) else "NO") if name in earlier else "-"
        print(f"{name:<22} {text:<32} {step:>14} {objective:>14} {row['wall_s']:>7.1f}  {verdict}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
