"""Which schedule family wins: the best plan of each family, and the one the search picks.

For GPT-8.3B in 16 stages, BERT-large and AmoebaNet-D on 16 GPUs, at a roomy and a tight memory budget
each, the predicted (simulated) step and peak memory of the best plan of every schedule family
(``plan(..., schedules=(family,))``; WPipe's with ``allow_stale_weights=True``), and the family ``plan()``
picks when it may use every synchronous one (WPipe, which changes the training rule, is not). The picked
plan should be no slower than the best single family (the "vs best" column: its step over the best
family's) unless that family's best needs memory decisions (sharded state, offloading, recompute or swap)
or has cuts the simulator moved, and gains less than the search's margin for them (said under the row), and
at the tight budget the winning family may change. "-" is a family with no plan that fits.

Run: python benchmarks/schedules.py [--quick]   (--quick: BERT-large only)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.errors import InvalidArgument, PlanInfeasible  # noqa: E402
from cost_models.units import format_bytes, format_ms  # noqa: E402
from examples.models.amoebanet import amoebanet_d  # noqa: E402
from examples.models.bert import bert_large  # noqa: E402
from examples.models.gpt import megatron_8_3b  # noqa: E402
from planner import plan, trace  # noqa: E402
from planner.assemble import REFINE_MUST_GAIN  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.plan.kinds import ScheduleKind  # noqa: E402
from planner.search.search import OFFLOAD_MUST_GAIN  # noqa: E402

# name: (builder, example input, global batch, device, (roomy, tight) budgets, fixed search options)
CASES: dict[str, tuple[Callable[[], torch.nn.Module], torch.Tensor, int, str, tuple[str, str], dict[str, Any]]] = {
    "gpt_8_3b": (megatron_8_3b, torch.zeros((1, 1024), dtype=torch.int64, device="meta"), 32, "V100-32GB",
                 ("32GB", "24GB"), {"num_stages": (16,)}),
    "bert_large": (bert_large, torch.zeros((1, 512), dtype=torch.int64, device="meta"), 128, "V100-16GB",
                   ("16GB", "2.5GB"), {}),
    "amoebanet_d": (amoebanet_d, torch.empty((1, 3, 224, 224), device="meta"), 64, "V100-16GB",
                    ("16GB", "1.5GB"), {}),
}


def _plan(model: torch.nn.Module, graph, inputs: torch.Tensor, batch: int, device: str, mem: str,
          options: dict[str, Any], schedules: tuple[str, ...]) -> Plan | None:
    stale = any(ScheduleKind(family).stale_weights for family in schedules)
    try:
        return plan(model, 16, mem, batch_size=batch, graph=graph, device=device, example_inputs=inputs,
                    schedules=schedules, allow_stale_weights=stale, **options)
    except (PlanInfeasible, InvalidArgument):
        return None


def _cell(result: Plan | None) -> str:
    if result is None:
        return "-"
    return f"{format_ms(result.predicted.step_ms)} {format_bytes(max(result.predicted.peak_mem_bytes))}"


def main() -> None:
    names = ["bert_large"] if "--quick" in sys.argv else list(CASES)
    families = [kind.value for kind in ScheduleKind]
    header = (f"{'model':<12} {'budget':>6} " + " ".join(f"{family:>20}" for family in families)
              + f" {'picked':>17} {'vs best':>8} {'plan s':>7}")
    print("best plan per family: simulated step and peak memory per GPU; picked: plan() over every synchronous "
          "family (wpipe, which trains on stale weights, only with allow_stale_weights: not among them)")
    print(header)
    print("-" * len(header))
    for name in names:
        builder, inputs, batch, device, budgets, options = CASES[name]
        with torch.device("meta"):
            model = builder()
        graph = trace(model, inputs)
        for mem in budgets:
            alone = {family: _plan(model, graph, inputs, batch, device, mem, options, (family,))
                     for family in families}
            start = time.perf_counter()
            synchronous = tuple(family for family in families if not ScheduleKind(family).stale_weights)
            picked = _plan(model, graph, inputs, batch, device, mem, options, synchronous)
            seconds = time.perf_counter() - start
            steps = [each.predicted.step_ms for family, each in alone.items() if each is not None
                     and family in synchronous]
            versus = "-" if picked is None or not steps else f"{picked.predicted.step_ms / min(steps):.3f}x"
            chosen = "-" if picked is None else picked.schedule.kind.value
            print(f"{name:<12} {mem:>6} " + " ".join(f"{_cell(alone[family]):>20}" for family in families)
                  + f" {chosen:>17} {versus:>8} {seconds:>7.1f}", flush=True)
            if picked is not None:
                print(f"{'':<20}picked: {picked.solver.why.split(';')[0]}; "
                      f"{picked.solver.why.split(';')[1].strip() if ';' in picked.solver.why else ''}", flush=True)
                fastest = min((each for family, each in alone.items() if each is not None and family in synchronous),
                              key=lambda each: each.predicted.step_ms)
                if picked.predicted.step_ms > fastest.predicted.step_ms and _decides(fastest) and not _decides(picked):
                    print(f"{'':<20}slower than {fastest.schedule.kind.value}'s best, which needs memory decisions: "
                          f"plan() takes those only for a gain of {OFFLOAD_MUST_GAIN:.0%} or more", flush=True)
                elif picked.predicted.step_ms > fastest.predicted.step_ms and _moved(fastest) and not _moved(picked):
                    print(f"{'':<20}slower than {fastest.schedule.kind.value}'s best, whose cuts the simulator moved: "
                          f"plan() takes those only for a gain of {REFINE_MUST_GAIN:.0%} or more", flush=True)


def _moved(result: Plan) -> bool:
    """Whether the simulator moved the plan's cuts from its solver's partition (planner.assemble.refined)."""
    return "cuts moved by the simulator" in result.solver.why


def _decides(result: Plan) -> bool:
    """Whether a plan shards, offloads, recomputes or swaps anything."""
    return any(not stage.offload.is_default for stage in result.stages)


if __name__ == "__main__":
    main()
