"""Memory decisions the search makes, executed: a plan from ``plan()`` under a budget that nothing
keeping every activation (or all model state on the GPU) fits, run on 2 ranks, equals a
single-process float64 run.

The search chooses which units to recompute and which to swap (tests/unit/test_memory_tiers.py
checks the choice itself); here the runtime executes exactly those decisions and the result is the
reference's: losses, every gradient, every parameter and the batch-norm running statistics.
"""

from __future__ import annotations

import json

import pytest

from planner.plan import Plan
from tests.dist.harness import run_ranks
from tests.dist.runtime_cases import Case, run_cases
from tests.dist.test_runtime import _check
from tests.runtime_plans import GPT, RESNET, searched_plan

pytestmark = pytest.mark.dist


def test_searched_recompute_and_swap_equal_a_single_process() -> None:
    cases = [Case(searched_plan(RESNET, gpus=2, budget_share=0.75, offload=("recompute", "swap"))),
             Case(searched_plan(RESNET, gpus=2, budget_share=0.9, offload=("swap",), batch_size=24))]
    for case in cases:
        stages = Plan.from_dict(json.loads(case.plan_json)).stages
        assert any(stage.offload.recompute or stage.offload.swap for stage in stages)
    outcomes = run_ranks(run_cases, 2, cases, timeout_s=240)
    for index, case in enumerate(cases):
        _check(case, [outcomes[rank][index] for rank in range(2)])


def test_searched_sharded_and_host_optimizer_plans_equal_a_single_process() -> None:
    """Model state is what does not fit: the search shards it over the replicas (ZeRO-1) or keeps the
    optimizer on the host, and the runtime executes that."""
    cases = [Case(searched_plan(GPT, gpus=2, budget_share=0.9, offload=("zero",), data_parallel=2,
                                optimizer="adam", batch_size=8, micro_batch_size=2), lr=1e-3),
             Case(searched_plan(GPT, gpus=2, budget_share=0.8, offload=("host",), optimizer="adam",
                                batch_size=8, micro_batch_size=2), lr=1e-3)]
    states = [{stage.offload.zero_stage for stage in Plan.from_dict(json.loads(case.plan_json)).stages}
              for case in cases]
    tiers = [{stage.offload.optimizer_state.value for stage in Plan.from_dict(json.loads(case.plan_json)).stages}
             for case in cases]
    assert states[0] == {1} and tiers[1] == {"host"}
    outcomes = run_ranks(run_cases, 2, cases, timeout_s=240)
    for index, case in enumerate(cases):
        _check(case, [outcomes[rank][index] for rank in range(2)])
