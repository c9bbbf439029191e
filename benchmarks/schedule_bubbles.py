"""Each schedule family's bubble, measured on 4 CPU ranks, against the simulator's.

One GPT cut into equal-layer parts (4, or 8 for interleaved 1F1B with 2 virtual stages per rank),
scheduled by every synchronous family (``planner.manual.reschedule``), run by the runtime on 4 gloo
processes (``python -m planner run ... --report``) and compared as ``tessera validate`` does:
  predicted   the simulator on the plan's predicted costs (node times measured on this CPU, one thread);
  replayed    the simulator on the compute times the run measured per action and the time it measured
              posting a message took (run report's ``rank_action_ms``), transfers as predicted: the
              schedule's own bubble;
  measured    1 - (busy time of every rank) / (sum of their steps), the runtime timing each compute action.
Every family runs ``--rounds`` times, the families alternating, so that the machine's drift reaches
them alike; the summary takes each family's median. Target: measured within 5 points of replayed,
and the families' measured order by step the predicted one (neighbours measured the other way are
listed with how far apart they were predicted and whether their measured ranges overlap).
``post pred/meas``: what posting one message costs a rank, as the cpu device measured it (the plan's)
and as the run did (mean over ranks). The machine may have fewer cores than ranks: note the load
average printed.

Run: python benchmarks/schedule_bubbles.py [--steps 8] [--ranks 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from plan_quality import equal_layer_starts  # noqa: E402

from cost_models.comm import p2p_post_ms  # noqa: E402
from cost_models.device_spec import LinkSpec  # noqa: E402
from cost_models.graph.model_spec import build_model, load_builder  # noqa: E402
from planner import trace  # noqa: E402
from planner.manual import plan_with_split, reschedule  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.reports.run_report import RunReport  # noqa: E402
from planner.simulation import simulate_measured  # noqa: E402

BUILDER = "examples/models/gpt.py:gpt"
MODEL = {"hidden": 128, "layers": 8, "heads": 4, "seq_len": 64, "vocab": 2048, "dropout": 0.0,
         "tie_embeddings": False}
BATCH, MICRO = 16, 2


def families(ranks: int) -> dict[str, tuple[int, str, dict[str, int]]]:
    """name: (parts, family, options) of every synchronous family on ``ranks`` ranks."""
    return {"gpipe": (ranks, "gpipe", {}),
            "1f1b": (ranks, "1f1b", {}),
            "interleaved-1f1b v=2": (2 * ranks, "interleaved-1f1b", {"virtual_stages": 2}),
            "zb-h1": (ranks, "zb-h1", {}),
            "gems-master": (ranks, "gems-master", {})}


def plans(ranks: int) -> dict[str, Plan]:
    model = build_model(load_builder(BUILDER, ROOT), MODEL, "cpu")  # real weights: its nodes are profiled
    x = torch.empty(1, MODEL["seq_len"], dtype=torch.long, device="meta")
    graph = trace(model, x)
    made = {}
    for name, (parts, family, options) in families(ranks).items():
        base = plan_with_split(model, example_inputs=x, graph=graph, stage_starts=equal_layer_starts(graph, parts),
                               batch_size=BATCH, micro_batch_size=MICRO, schedule="gpipe", device="cpu",
                               optimizer="momentum", builder=BUILDER, builder_kwargs=MODEL)
        made[name] = reschedule(base, family, **options)
    return made


def run(plan: Plan, steps: int, folder: Path) -> RunReport:
    plan_path, report_path = folder / "plan.json", folder / "run.json"
    plan.save(plan_path)
    result = subprocess.run([sys.executable, "-m", "planner", "run", str(plan_path), "--steps", str(steps), "--",
                             "--report", str(report_path)], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    if result.returncode:
        raise RuntimeError(f"the run failed: {result.stderr[-2000:]}")
    return RunReport.load(report_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4, help="CPU ranks (default 4; 2 on a 2-core machine keeps "
                                                             "one core per rank)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every family, alternating (default 2)")
    args = parser.parse_args()
    print(f"GPT {MODEL}, batch {BATCH} in micro-batches of {MICRO}, {args.ranks} gloo CPU ranks x 1 thread on "
          f"{os.cpu_count()} cores, {args.rounds} rounds of the families alternating, "
          f"{args.steps} steps a run (the first warms up); load average {os.getloadavg()[0]:.1f} at the start")
    print(f"{'round family':<24} {'predicted':>9} {'replayed':>9} {'measured':>9} {'meas-repl':>9} "
          f"{'pred. step':>10} {'meas. step':>10} {'post pred/meas':>15}")
    made = plans(args.ranks)
    gaps: dict[str, list[float]] = {name: [] for name in made}  # measured - replayed bubble, per round
    steps: dict[str, list[float]] = {name: [] for name in made}  # measured median step, per round
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for name, plan in made.items():
                report = run(plan, args.steps, Path(tmp))
                replayed = simulate_measured(plan, report.rank_action_ms)
                measured = report.bubble_fraction or 0.0
                gaps[name].append((measured - replayed.bubble_fraction) * 100)
                steps[name].append(report.median_step_ms)
                posts = [ranks["post"] for ranks in report.rank_action_ms if "post" in ranks]
                planned_post_ms = p2p_post_ms(LinkSpec.from_dict(plan.cluster.device["intra_node"]))
                print(f"{round_index + 1} {name:<22} {plan.predicted.bubble_fraction:>9.1%} "
                      f"{replayed.bubble_fraction:>9.1%} {measured:>9.1%} {gaps[name][-1]:>+8.1f}pt "
                      f"{plan.predicted.step_ms:>8.1f}ms {report.median_step_ms:>8.1f}ms "
                      f"{planned_post_ms:>6.2f}/{sum(posts) / max(1, len(posts)):.2f}ms", flush=True)
    print(f"\n{'family':<22} {'meas-repl (median)':>18} {'pred. step':>10} {'meas. step median (range)':>28}")
    for name, plan in made.items():
        print(f"{name:<22} {statistics.median(gaps[name]):>+16.1f}pt {plan.predicted.step_ms:>8.1f}ms "
              f"{statistics.median(steps[name]):>10.1f}ms ({min(steps[name]):.1f}..{max(steps[name]):.1f})")
    predicted_order = sorted(made, key=lambda name: made[name].predicted.step_ms)
    measured_order = sorted(made, key=lambda name: statistics.median(steps[name]))
    print(f"fastest first, predicted: {', '.join(predicted_order)}")
    print(f"fastest first, measured:  {', '.join(measured_order)}")
    print(f"orders match: {predicted_order == measured_order}")
    for first, second in itertools.pairwise(predicted_order):  # neighbours the run put the other way
        if statistics.median(steps[first]) > statistics.median(steps[second]):
            apart = made[second].predicted.step_ms / made[first].predicted.step_ms - 1
            overlap = min(steps[first]) <= max(steps[second])
            print(f"  {first} before {second}: predicted {apart:.1%} apart; measured the other way, "
                  f"{'their ranges overlapping' if overlap else 'their ranges apart'}")


if __name__ == "__main__":
    main()
