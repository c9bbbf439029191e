"""Predicted against measured: step time and peak memory per rank of tessera's CPU plans, run for real.

Eight plans on 2 and 4 CPU ranks (GPT, ResNet, U-Net; GPipe and 1F1B; pipeline-only, data-parallel-only
and mixed; one, bf16 with Adam at one sample a micro-batch, whose peak is its optimizer step; one of a GPT whose
head is its embedding, summed over both stages before each step), each made by ``tessera plan --device cpu`` (node times measured on this machine, its gloo
link measured once and cached) with the stage count, replicas and schedule fixed, run by
``tessera run`` (gloo, one thread per rank) with a run report, and compared as ``tessera validate``
does (planner/reports/compare.py): per rank, the predicted and the measured median step and peak
memory (the CPU meter: allocations of the profiled last step on top of the model state), the error in
percent, and the worst of each. ``compute`` is the rank's busy time per step (its compute actions) against the
plan's: how much slower or faster the layers ran than profiled. ``replay`` is the step's error with the
schedule replayed on the run's own per-action compute times (``tessera validate``'s "step time on measured
compute"): what the model of transfers, waits and all-reduces misses, apart from the per-layer times (whose
error includes the machine's drift between profiling and the run: on a shared VM its cores' speed changes by
up to 1.5x from one minute to the next). Targets: every step within 10%, every peak memory within 5%. Each plan runs
``--runs`` times (the median of their medians is compared; their range shows how much the machine drifts).
The machine may have fewer cores than ranks: such rows are marked and their worst case printed apart
(the cpu device is measured one rank per core; plan() warns when a node has more ranks than cores).

Run: python benchmarks/fidelity.py [--steps 16] [--runs 2] [--only NAME] [--fresh-cache]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models.cpu_device import usable_cores  # noqa: E402
from cost_models.units import format_bytes, format_ms  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.reports.compare import checks  # noqa: E402
from planner.reports.run_report import RunReport  # noqa: E402
from planner.simulation import simulate_plan  # noqa: E402

GPT = ["examples/models/gpt.py:gpt", "--model-arg", "hidden=128", "--model-arg", "layers=4", "--model-arg", "heads=4",
       "--model-arg", "seq_len=64", "--model-arg", "vocab=2048", "--model-arg", "dropout=0.0",
       "--model-arg", "tie_embeddings=false", "--input", "64:int64"]
_UNTIED = GPT.index("tie_embeddings=false")
TIED_GPT = GPT[:_UNTIED - 1] + GPT[_UNTIED + 1:]  # the same GPT, its head the embedding (the builder's default)
RESNET = ["examples/models/resnet.py:resnet50", "--model-arg", "width=8", "--model-arg", "num_classes=10",
          "--input", "3x64x64"]
UNET = ["examples/models/unet.py:unet_small", "--input", "3x64x64"]

MOMENTUM = ["--optimizer", "momentum"]
# the step's own buffers outgrow one sample's activations: the peak is the optimizer step (fp32 copies, Adam)
AT_THE_STEP = ["--optimizer", "adam", "--precision", "bf16"]

# name: (model arguments, ranks, stages, replicas, schedule, batch, micro-batch, training options)
PLANS: dict[str, tuple[list[str], int, int, int, str, int, int, list[str]]] = {
    "gpt pipeline 1f1b": (GPT, 2, 2, 1, "1f1b", 16, 2, MOMENTUM),
    "gpt data-parallel": (GPT, 2, 1, 2, "gpipe", 16, 4, MOMENTUM),
    "gpt 2x2 gpipe": (GPT, 4, 2, 2, "gpipe", 16, 2, MOMENTUM),
    "resnet pipeline gpipe": (RESNET, 2, 2, 1, "gpipe", 16, 4, MOMENTUM),
    "resnet pipeline 1f1b": (RESNET, 4, 4, 1, "1f1b", 16, 2, MOMENTUM),
    "unet pipeline 1f1b": (UNET, 2, 2, 1, "1f1b", 8, 2, MOMENTUM),
    "gpt bf16 adam, step peak": (GPT, 2, 2, 1, "1f1b", 4, 1, AT_THE_STEP),
    "tied gpt pipeline gpipe": (TIED_GPT, 2, 2, 1, "gpipe", 16, 2, MOMENTUM),  # its stages sum the embedding's
}


def tessera(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "planner", *args], cwd=ROOT, capture_output=True, text=True,
                            env=env, check=False)
    if result.returncode:
        raise RuntimeError(f"tessera {' '.join(args[:2])} failed: {result.stderr.strip().splitlines()[-1:]}")
    return result


def measure(name: str, folder: Path, steps: int, runs: int) -> tuple[Plan, list[RunReport]]:
    """Plan ``name`` and run it ``runs`` times (the machine's speed drifts: the runs show by how much)."""
    model, ranks, stages, replicas, schedule, batch, micro, training = PLANS[name]
    plan_file = folder / "plan.json"
    tessera("plan", *model, "--batch-size", str(batch), "--gpus", str(ranks), "--mem", "8GB", "--device", "cpu",
            "--num-stages", str(stages), "--data-parallel", str(replicas), "--schedule", schedule,
            "--micro-batch-size", str(micro), *training, "--no-offload", "--no-spatial",
            "-o", str(plan_file), "-q")
    reports = []
    for run in range(runs):
        report = folder / f"run{run}.json"
        tessera("run", str(plan_file), "--steps", str(steps), "--", "--report", str(report))
        reports.append(RunReport.load(report))
    return Plan.load(plan_file), reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="steps per run (the first is a warm-up)")
    parser.add_argument("--runs", type=int, default=2, help="runs per plan; the table shows their median")
    parser.add_argument("--only", choices=list(PLANS), default=None)
    parser.add_argument("--fresh-cache", action="store_true",
                        help="measure the cpu device and the node times afresh for each plan, just before its runs "
                             "(a temporary cache per plan: the machine drifts less between profile and run)")
    args = parser.parse_args()
    cores = usable_cores()
    print(f"load average {os.getloadavg()[0]:.1f} on {cores} cores; {args.runs} runs of {args.steps} steps per "
          f"plan (median of the runs' medians; the spread is their range)")
    print(f"{'plan':<26} {'rank':>4} {'step pred':>10} {'measured':>10} {'spread':>16} {'error':>8} {'compute':>8} "
          f"{'replay':>8} {'peak pred':>11} {'measured':>11} {'error':>8}")
    worst: dict[tuple[str, bool], tuple[float, str]] = {}  # (metric, on shared cores) -> worst
    for name in [args.only] if args.only else list(PLANS):
        with tempfile.TemporaryDirectory() as tmp:
            if args.fresh_cache:  # each plan's own, measured just before its runs
                os.environ["TESSERA_CACHE_DIR"] = str(Path(tmp) / "cache")
            plan, reports = measure(name, Path(tmp), args.steps, args.runs)
        shared = plan.layout.world_size > cores
        runs = [checks(plan, report) for report in reports]
        replays = [next(c for c in found if c.metric == "step time on measured compute") for found in runs]
        replay = statistics.median(c.error_pct for c in replays)
        predicted_busy_ms = simulate_plan(plan).busy_ms
        for rank in range(plan.layout.world_size):
            steps = [next(c for c in found if c.rank == rank and c.metric == "step time") for found in runs]
            memory = next(c for c in runs[0] if c.rank == rank and c.metric == "peak memory")
            measured = statistics.median(c.measured for c in steps)
            error = 100 * (measured - steps[0].predicted) / steps[0].predicted
            spread = f"{format_ms(min(c.measured for c in steps))}..{format_ms(max(c.measured for c in steps))}"
            busy_ms = statistics.median(report.rank_median_busy_ms[rank] for report in reports)
            compute = 100 * (busy_ms / predicted_busy_ms[rank] - 1)
            print(f"{name:<26} {rank:>4} {format_ms(steps[0].predicted):>10} {format_ms(measured):>10} "
                  f"{spread:>16} {error:>+7.1f}% {compute:>+7.1f}% {replay:>+7.1f}% "
                  f"{format_bytes(memory.predicted):>11} {format_bytes(memory.measured):>11} {memory.error_pct:>+7.1f}%"
                  + ("  (ranks share cores)" if shared else ""))
            for metric, value in (("step time", error), ("peak memory", memory.error_pct)):
                key = (metric, shared)
                worst[key] = max(worst.get(key, (0.0, "")), (abs(value), f"{name} rank {rank}: {value:+.1f}%"))
        key = ("step time on measured compute", shared)  # the job's: one figure per plan
        worst[key] = max(worst.get(key, (0.0, "")), (abs(replay), f"{name}: {replay:+.1f}%"))
    for metric, target in (("step time", 10), ("step time on measured compute", 10), ("peak memory", 5)):
        for shared, where in ((False, "a core per rank"), (True, f"more ranks than the {cores} cores")):
            if (metric, shared) in worst:
                print(f"worst {metric}, {where}: {worst[(metric, shared)][1]} (target within {target}%)")


if __name__ == "__main__":
    main()
