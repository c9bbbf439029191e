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

from examples.models.gpt import gpt_tiny
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


def test_searched_gradients_sent_to_the_host_equal_a_single_process_and_leave_the_device() -> None:
    """At the least budget the search names with the optimizer on the host and gradients sent there, it sends
    them (ZeRO-Offload), and on 2 ranks the run equals a single process. On 1 CPU rank under 1F1B (whose peak,
    a micro-batch's forward after the first backward, holds the gradients), the measured device peak is the
    host-tier plan's less every gradient of the model; the plan bounds it from above by at most what it counts
    and the runtime does not hold there: the tied embedding's gradient (the plan keeps a weight several units
    share on the device, the runtime sends it where one stage holds all its uses) and the cast of the largest
    gradient before it goes down (none on a CPU rank in the masters' dtype)."""
    from tests.dist.test_step_memory import _profiled_peak

    common = {"optimizer": "adam", "batch_size": 8, "micro_batch_size": 2}
    pipeline = Case(searched_plan(GPT, gpus=2, tightest=True, offload=("host", "grads"), **common), lr=1e-3)
    assert all(stage.offload.grads_on_host for stage in Plan.from_dict(json.loads(pipeline.plan_json)).stages)
    outcomes = run_ranks(run_cases, 2, [pipeline], timeout_s=240)
    _check(pipeline, [outcomes[rank][0] for rank in range(2)])

    sent, kept = (searched_plan(GPT, gpus=1, tightest=True, offload=offload, schedule="1f1b", **common)
                  for offload in (("host", "grads"), ("host",)))
    plans = [Plan.from_dict(json.loads(text)) for text in (sent, kept)]
    assert [plans[0].stages[0].offload.grads_on_host, plans[1].stages[0].offload.grads_on_host] == [True, False]
    measured_sent, measured_kept = (run_ranks(_profiled_peak, 1, text, timeout_s=120)[0] for text in (sent, kept))
    assert measured_kept - measured_sent == 8 * sum(param.numel() for param in gpt_tiny().parameters())
    predicted = plans[0].predicted.peak_mem_bytes[0]
    embedding_grad_bytes = plans[0].stages[0].predicted.grad_bytes  # the shared weight's, all the plan keeps
    largest_cast_bytes = 8 * 64 * 256  # the MLP's weights (hidden 64, 4 x 64 wide), in float64
    assert measured_sent <= predicted <= measured_sent + embedding_grad_bytes + largest_cast_bytes
