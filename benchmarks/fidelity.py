"""Predicted against measured: step time and peak memory per rank of tessera's CPU plans, run for real.

Six plans on 2 and 4 CPU ranks (GPT, ResNet, U-Net; GPipe and 1F1B; pipeline-only, data-parallel-only
and mixed), each made by ``tessera plan --device cpu`` (node times measured on this machine, its gloo
link measured once and cached) with the stage count, replicas and schedule fixed, run by
``tessera run`` (gloo, one thread per rank) with a run report, and compared as ``tessera validate``
does (planner/reports/compare.py): per rank, the predicted and the measured median step and peak
memory (the CPU meter: allocations of the profiled last step on top of the model state), the error in
percent, and the worst of each. Targets: every step within 10%, every peak memory within 5%. The machine
may have fewer cores than ranks: the load average is printed.

Run: python benchmarks/fidelity.py [--steps 8] [--only NAME]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models.units import format_bytes, format_ms  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.reports.compare import checks  # noqa: E402
from planner.reports.run_report import RunReport  # noqa: E402

GPT = ["examples/models/gpt.py:gpt", "--model-arg", "hidden=128", "--model-arg", "layers=4", "--model-arg", "heads=4",
       "--model-arg", "seq_len=64", "--model-arg", "vocab=2048", "--model-arg", "dropout=0.0",
       "--model-arg", "tie_embeddings=false", "--input", "64:int64"]
RESNET = ["examples/models/resnet.py:resnet50", "--model-arg", "width=8", "--model-arg", "num_classes=10",
          "--input", "3x64x64"]
UNET = ["examples/models/unet.py:unet_small", "--input", "3x64x64"]

# name: (model arguments, ranks, stages, replicas, schedule, batch, micro-batch)
PLANS: dict[str, tuple[list[str], int, int, int, str, int, int]] = {
    "gpt pipeline 1f1b": (GPT, 2, 2, 1, "1f1b", 16, 2),
    "gpt data-parallel": (GPT, 2, 1, 2, "gpipe", 16, 4),
    "gpt 2x2 gpipe": (GPT, 4, 2, 2, "gpipe", 16, 2),
    "resnet pipeline gpipe": (RESNET, 2, 2, 1, "gpipe", 16, 4),
    "resnet pipeline 1f1b": (RESNET, 4, 4, 1, "1f1b", 16, 2),
    "unet pipeline 1f1b": (UNET, 2, 2, 1, "1f1b", 8, 2),
}


def tessera(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "planner", *args], cwd=ROOT, capture_output=True, text=True,
                            env=env, check=False)
    if result.returncode:
        raise RuntimeError(f"tessera {' '.join(args[:2])} failed: {result.stderr.strip().splitlines()[-1:]}")
    return result


def measure(name: str, folder: Path, steps: int) -> tuple[Plan, RunReport]:
    model, ranks, stages, replicas, schedule, batch, micro = PLANS[name]
    plan_file, report = folder / "plan.json", folder / "run.json"
    tessera("plan", *model, "--batch-size", str(batch), "--gpus", str(ranks), "--mem", "8GB", "--device", "cpu",
            "--num-stages", str(stages), "--data-parallel", str(replicas), "--schedule", schedule,
            "--micro-batch-size", str(micro), "--optimizer", "momentum", "--no-offload", "--no-spatial",
            "-o", str(plan_file), "-q")
    tessera("run", str(plan_file), "--steps", str(steps), "--", "--report", str(report))
    return Plan.load(plan_file), RunReport.load(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first is a warm-up)")
    parser.add_argument("--only", choices=list(PLANS), default=None)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.steps} steps per run")
    print(f"{'plan':<24} {'rank':>4} {'step pred':>10} {'measured':>10} {'error':>8} "
          f"{'peak pred':>11} {'measured':>11} {'error':>8}")
    worst_step: tuple[float, str] = (0.0, "")
    worst_memory: tuple[float, str] = (0.0, "")
    for name in [args.only] if args.only else list(PLANS):
        with tempfile.TemporaryDirectory() as tmp:
            plan, report = measure(name, Path(tmp), args.steps)
        found = checks(plan, report)
        for rank in range(plan.layout.world_size):
            step = next(c for c in found if c.rank == rank and c.metric == "step time")
            memory = next(c for c in found if c.rank == rank and c.metric == "peak memory")
            print(f"{name:<24} {rank:>4} {format_ms(step.predicted):>10} {format_ms(step.measured):>10} "
                  f"{step.error_pct:>+7.1f}% {format_bytes(memory.predicted):>11} "
                  f"{format_bytes(memory.measured):>11} {memory.error_pct:>+7.1f}%")
            worst_step = max(worst_step, (abs(step.error_pct), f"{name} rank {rank}: {step.error_pct:+.1f}%"))
            worst_memory = max(worst_memory, (abs(memory.error_pct), f"{name} rank {rank}: {memory.error_pct:+.1f}%"))
    print(f"worst step time: {worst_step[1]} (target within 10%)")
    print(f"worst peak memory: {worst_memory[1]} (target within 5%)")


if __name__ == "__main__":
    main()
