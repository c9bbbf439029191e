"""Plans whose spatial stage the search chose (plan(), not a hand-made split) run and equal a
single-process float64 run: ResNet-50 (width 4, 64x64) on 3 ranks in 2 stages of 1 replica, which
only stage 0 on 2 tiles + 1 rank can use, wherever the ILP ends the tiles and whichever halo groups
the search fuses: GPipe and 1F1B keeping every activation, GPipe under a budget that makes the
search recompute on the tiles (a recompute region holding a fused group), and 1F1B on a device
whose messages are slow enough that fusing is sure to pay. Each tile rank's halo bytes in the step
(the run report's count) equal the plan's prediction exactly.
"""

from __future__ import annotations

import json

import pytest
import torch

from cost_models.device_spec import DeviceSpec
from cost_models.errors import PlanInfeasible
from cost_models.graph.model_spec import build_model, load_builder
from planner import plan
from planner.plan import HaloMode, Plan, Slicing
from runtime.build import default_dtype
from tests.dist.harness import run_ranks
from tests.dist.runtime_cases import Case, reference, run_cases
from tests.dist.test_spatial_runtime import assert_rank_equals
from tests.runtime_plans import RESNET, latency_bound_device

pytestmark = pytest.mark.dist

KWARGS = {"width": 4, "num_classes": 10}


def _searched(schedule: str, *, budget_share: float | None = None,
              device: str | DeviceSpec = "V100-16GB") -> str:
    """The search's plan; with ``budget_share``, for that share of the least memory keeping everything."""
    with default_dtype(torch.float64):
        model = build_model(load_builder(RESNET), KWARGS, "meta")
    common = dict(gpus=3, batch_size=4, micro_batch_sizes=(2,), num_stages=(2,), data_parallel=(1,),
                  device=device, schedules=(schedule,), precision="fp64", optimizer="momentum", reserve=0,
                  example_inputs=torch.empty(1, 3, 64, 64, dtype=torch.float64, device="meta"), builder=RESNET,
                  builder_kwargs=KWARGS)
    if budget_share is None:
        return plan(model, mem="16GB", offload=False, **common).to_json()
    try:
        plan(model, mem=1, offload=False, **common)
        raise AssertionError("a 1-byte budget fitted")
    except PlanInfeasible as error:
        need = error.min_mem_bytes
    return plan(model, mem=int(need * budget_share), offload=("recompute",), **common).to_json()


def test_searched_spatial_plans_equal_a_single_process_and_send_the_predicted_halos() -> None:
    cases = [Case(_searched("gpipe"), steps=1), Case(_searched("1f1b"), steps=1),
             Case(_searched("gpipe", budget_share=0.8), steps=1),
             Case(_searched("1f1b", device=latency_bound_device()), steps=1)]
    plans = [Plan.from_dict(json.loads(case.plan_json)) for case in cases]
    for each in plans:
        spatial = each.stages[0].spatial
        assert spatial is not None and (spatial.parts, spatial.slicing) == (2, Slicing.VERTICAL)
    assert plans[2].stages[0].offload.recompute, "the tight budget should make the search recompute on the tiles"
    fused = plans[3].stages[0].spatial
    assert fused is not None and fused.halo is HaloMode.FUSED and fused.fused_groups, "slow links: fuse halos"
    budget = plans[2].stages[0]
    assert any(set(group) < set(region) for group in budget.spatial.fused_groups  # type: ignore[union-attr]
               for region in budget.offload.recompute), "a recompute region should hold a fused group whole"
    outcomes = run_ranks(run_cases, 3, cases, timeout_s=240)
    expected = reference(cases[0])  # same model, batches and optimizer for every case
    for index, each in enumerate(plans):
        by_rank = [outcomes[rank][index] for rank in range(3)]
        for rank, outcome in enumerate(by_rank):
            assert_rank_equals(rank, outcome, expected)
        assert set().union(*(outcome.grads for outcome in by_rank)) == set(expected.grads)
        halo = each.stages[0].spatial.halo_bytes  # type: ignore[union-attr]
        predicted = [count * each.training.num_microbatches for count in halo] + [0]
        assert [outcome.halo_bytes_sent for outcome in by_rank] == predicted, f"case {index}"
