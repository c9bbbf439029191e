"""Each schedule family's bubble and step, measured on CPU ranks, against the simulator's.

One GPT cut into equal-layer parts (4, or 8 for interleaved 1F1B with 2 virtual stages per rank),
scheduled by every synchronous family (``planner.manual.reschedule``), run by the runtime on 4 gloo
processes, every family's executor built side by side in the same processes and their steps alternating
(each family's step starting on every rank together), so that the machine's drifts in speed reach the
families alike; each family's steps make a run report as ``tessera run --report`` does, compared as
``tessera validate`` does:
  predicted   the simulator on the plan's predicted costs (node times measured on this CPU, one thread);
  replayed    the simulator on the compute times the run measured per action and the time it measured
              posting a message took (run report's ``rank_action_ms``), transfers as predicted: the
              schedule's own bubble;
  measured    1 - (busy time of every rank) / (sum of their steps), the runtime timing each compute action.
Targets: measured within 5 points of replayed, and the families' measured order by step the predicted one.
The measured order is by each family's median step over the predicted-fastest family's step next to it
(paired steps: a drift divides out); that ratio's error against the predicted ratio is printed (how far the
model misjudges one family against another, whatever the machine's speed). Families predicted within
``--tie`` percent of each other are tied (no order predicted between them); every pair measured the other
way is listed with how far apart both put them, and the widest predicted gap among them closes the table
(pairs the model put further apart all ran in its order). ``post pred/meas``: what posting one message costs
a rank, as the cpu device measured it (the plan's) and as the run did (mean over ranks); ``worst peak``: the
rank's peak memory furthest from its prediction (one more step of each family, profiled). The machine may
have fewer cores than ranks: note the load average printed.

Run: python benchmarks/schedule_bubbles.py [--steps 31] [--ranks 4] [--tie 1] [--tied-weights]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from plan_quality import equal_layer_starts  # noqa: E402
from runtime_vs_pipelining import spawned  # noqa: E402

from cost_models.comm import p2p_post_ms  # noqa: E402
from cost_models.cpu_device import settle_cpu_rank  # noqa: E402
from cost_models.device_spec import LinkSpec  # noqa: E402
from cost_models.graph.model_spec import build_model, load_builder  # noqa: E402
from planner import trace  # noqa: E402
from planner.manual import plan_with_split, reschedule  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.reports.run_report import RunReport  # noqa: E402
from planner.simulation import simulate_measured  # noqa: E402
from runtime.report import gather_report  # noqa: E402
from runtime.train import RunOptions, StepTimings, prepare, step_microbatches  # noqa: E402

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


def plans(ranks: int, kwargs: dict[str, Any]) -> dict[str, Plan]:
    model = build_model(load_builder(BUILDER, ROOT), kwargs, "cpu")  # real weights: its nodes are profiled
    x = torch.empty(1, kwargs["seq_len"], dtype=torch.long, device="meta")
    graph = trace(model, x)
    made = {}
    for name, (parts, family, options) in families(ranks).items():
        base = plan_with_split(model, example_inputs=x, graph=graph, stage_starts=equal_layer_starts(graph, parts),
                               batch_size=BATCH, micro_batch_size=MICRO, schedule="gpipe", device="cpu",
                               optimizer="momentum", builder=BUILDER, builder_kwargs=kwargs)
        made[name] = reschedule(base, family, **options)
    return made


def _rank(rank: int, init_file: str, world: int, texts: dict[str, str], steps: int, results: Any) -> None:
    """One rank: every family's executor built side by side, their steps alternating (each between barriers
    so that they start together), then one step more of each with its memory profiled, and one run report
    per family, as ``tessera run --report`` writes it."""
    torch.set_num_threads(1)
    settle_cpu_rank(rank, world)  # as `tessera run`'s CPU ranks are
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    device = torch.device("cpu")
    made = {name: Plan.from_dict(json.loads(text)) for name, text in texts.items()}
    options = RunOptions(plan=Path("-"), steps=steps, timeout_s=300)
    prepared = {name: prepare(plan, options, device) for name, plan in made.items()}
    timings = {name: StepTimings() for name in made}
    losses: dict[str, list[float]] = {name: [] for name in made}
    for step in range(steps):
        for name, (executor, data) in prepared.items():
            microbatches = step_microbatches(executor, data, step)
            dist.barrier()
            began = time.perf_counter()
            losses[name].append(executor.run(microbatches))
            timings[name].add(executor, (time.perf_counter() - began) * 1e3)
    sent = {name: executor.p2p_bytes_sent for name, (executor, _) in prepared.items()}  # a steady step's
    for name, (executor, data) in prepared.items():  # one step more, its memory profiled (not timed)
        executor.run(step_microbatches(executor, data, steps), profile_memory=True)
    reports = {name: gather_report(timings[name].step_ms, losses[name], executor.memory.peak_bytes,
                                   executor.memory.held_bytes, fingerprint=made[name].model.fingerprint,
                                   device=device, global_batch_size=made[name].training.global_batch_size,
                                   start_step=0, p2p_bytes_sent=sent[name], busy_ms=timings[name].busy_ms,
                                   action_ms=timings[name].summary())
               for name, (executor, _) in prepared.items()}
    if rank == 0:
        results.put({name: report.to_dict() for name, report in reports.items()})
    dist.barrier()
    dist.destroy_process_group()


def measure(made: dict[str, Plan], ranks: int, steps: int) -> dict[str, RunReport]:
    """Every family's run report, their steps alternating in one set of ``ranks`` processes."""
    texts = {name: plan.to_json() for name, plan in made.items()}
    answers = spawned(_rank, ranks, ranks, texts, steps)
    return {name: RunReport.from_dict(answer) for name, answer in answers.items()}


def paired_ratio(report: RunReport, reference: RunReport) -> float:
    """The median over timed steps of this family's step over the reference family's same-index step: they
    ran next to each other, so a drift of the machine's speed divides out."""
    return statistics.median(mine / theirs for mine, theirs in zip(report.timed_ms, reference.timed_ms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=31, help="steps per family, the first warming up (default 31)")
    parser.add_argument("--ranks", type=int, default=4, help="CPU ranks (default 4; 2 on a 2-core machine keeps "
                                                             "one core per rank)")
    parser.add_argument("--tie", type=float, default=1.0, help="families predicted within this many percent of "
                                                                "each other are tied: no order between them is "
                                                                "predicted (default 1)")
    parser.add_argument("--tied-weights", action="store_true", help="tie the GPT's embedding to its head: the first and "
                                                                "last parts sum its gradient before each step")
    parser.add_argument("--save", type=Path, help="a folder to write each family's plan and run report to (for "
                                                  "tessera validate)")
    args = parser.parse_args()
    kwargs = {**MODEL, "tie_embeddings": args.tied_weights}
    print(f"GPT {kwargs}, batch {BATCH} in micro-batches of {MICRO}, {args.ranks} gloo CPU ranks x 1 thread on "
          f"{os.cpu_count()} cores, the families' steps alternating, {args.steps} steps each (the first warms "
          f"up); load average {os.getloadavg()[0]:.1f} at the start")
    made = plans(args.ranks, kwargs)
    reports = measure(made, args.ranks, args.steps)
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        for name, plan in made.items():
            stem = name.split()[0]
            plan.save(args.save / f"{stem}.plan.json")
            reports[name].save(args.save / f"{stem}.run.json")
    fastest = min(made, key=lambda name: made[name].predicted.step_ms)
    print(f"{'family':<22} {'predicted':>9} {'replayed':>9} {'measured':>9} {'meas-repl':>9} "
          f"{'pred. step':>10} {'meas. step (quartiles)':>26} {'step / ' + fastest + ' pred, meas, error':>38} "
          f"{'post pred/meas':>15} {'worst peak':>10}")
    for name, plan in made.items():
        report = reports[name]
        replayed = simulate_measured(plan, report.rank_action_ms)
        measured = report.bubble_fraction or 0.0
        posts = [ranks["post"] for ranks in report.rank_action_ms if "post" in ranks]
        planned_post_ms = p2p_post_ms(LinkSpec.from_dict(plan.cluster.device["intra_node"]))
        quartiles = statistics.quantiles(report.timed_ms, n=4)
        predicted_ratio = plan.predicted.step_ms / made[fastest].predicted.step_ms
        measured_ratio = paired_ratio(report, reports[fastest])
        peak_error = max((measured / predicted - 1 for measured, predicted in
                          zip(report.peak_mem_bytes, plan.predicted.peak_mem_bytes)), key=abs)
        print(f"{name:<22} {plan.predicted.bubble_fraction:>9.1%} {replayed.bubble_fraction:>9.1%} "
              f"{measured:>9.1%} {(measured - replayed.bubble_fraction) * 100:>+8.1f}pt "
              f"{plan.predicted.step_ms:>8.1f}ms {report.median_step_ms:>8.1f}ms "
              f"({quartiles[0]:.1f}..{quartiles[2]:.1f}) "
              f"{predicted_ratio:>20.3f} {measured_ratio:.3f} {measured_ratio / predicted_ratio - 1:>+7.1%} "
              f"{planned_post_ms:>6.2f}/{sum(posts) / max(1, len(posts)):.2f}ms {peak_error:>+10.1%}", flush=True)
    predicted_order = sorted(made, key=lambda name: made[name].predicted.step_ms)
    measured_order = sorted(made, key=lambda name: paired_ratio(reports[name], reports[fastest]))
    print(f"fastest first, predicted: {', '.join(predicted_order)}")
    print(f"fastest first, measured:  {', '.join(measured_order)} (by the median of paired step ratios)")
    contrary = []  # how far apart the model put each pair the run put the other way
    for first, second in itertools.combinations(predicted_order, 2):
        apart = made[second].predicted.step_ms / made[first].predicted.step_ms - 1
        measured_apart = paired_ratio(reports[second], reports[first]) - 1
        if measured_apart < 0:
            contrary.append(apart)
            print(f"  {first} before {second}: predicted {apart:.1%} apart"
                  f"{' (tied)' if apart * 100 < args.tie else ''}; measured {-measured_apart:.1%} the other way")
    print(f"orders match: {measured_order == predicted_order}; apart from ties within {args.tie:g}%: "
          f"{all(apart * 100 < args.tie for apart in contrary)}; every pair predicted more than "
          f"{max(contrary, default=0.0):.1%} apart measured in the predicted order")


if __name__ == "__main__":
    main()
