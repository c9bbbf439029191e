"""Tied weights' gradient sums: which parts of a partition sum them (as the runtime groups them), over which
ranks and at what cost, and that a plan's replay waits for them (planner/schedules/simulate.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cost_models.comm import allreduce_link, ring_allreduce_ms
from cost_models.devices import get_device
from planner.plan import Plan
from planner.simulation import simulate_plan
from runtime.build import rebuild_model, split_stages, trace_checked
from runtime.dataflow import dataflow
from runtime.grads import tied_sets
from runtime.stages import stage_param_names
from runtime.values import value_specs
from tests.runtime_plans import GPT, looped, make_plan, scheduled

TWO = ["blocks_1_ln_1"]  # gpt_tiny (tied embedding and head) in two parts of a block each
FOUR = ["blocks_0_ln_2", "blocks_1_ln_1", "blocks_1_ln_2"]
EMBEDDING_BYTES = 512 * 64 * 8  # its gradient: vocab x hidden in float64


def _runtime_tied(plan: Plan) -> dict[tuple[int, ...], tuple[str, ...]]:
    """The parts the runtime sums tied gradients over, and which (runtime/setup.py builds its groups from these)."""
    model = rebuild_model(plan)
    traced = trace_checked(model, plan)
    modules = split_stages(traced, model, plan)
    inputs = [(meta.shape, getattr(torch, meta.dtype)) for meta in plan.model.example_inputs]
    flow = dataflow(traced, modules, plan.part_of(), value_specs(traced, inputs, plan.training.micro_batch_size))
    return tied_sets(stage_param_names(model, modules, flow))


def _ring_ms(plan: Plan, ranks: list[int]) -> float:
    return ring_allreduce_ms(EMBEDDING_BYTES, len(ranks), allreduce_link(get_device("V100-16GB"), ranks,
                                                                         plan.cluster.gpus_per_node))


@pytest.mark.parametrize(("make", "parts", "ranks", "printed"), [
    (lambda: make_plan(GPT, TWO, schedule="gpipe"), (0, 1), [0, 1], "stages 0 and 1 (ranks 0, 1)"),
    (lambda: make_plan(GPT, TWO, schedule="1f1b", data_parallel=2), (0, 1), [0, 1, 2, 3],  # both replicas
     "stages 0 and 1 (ranks 0-3)"),
    (lambda: scheduled(make_plan(GPT, FOUR, schedule="gpipe"), "interleaved-1f1b", virtual_stages=2), (0, 3),
     [0, 1], "stages 0 and 3 (ranks 0, 1)"),
    (lambda: scheduled(make_plan(GPT, TWO, schedule="gpipe"), "gems-master"), (0, 1), [0, 1],
     "stages 0, 1, 2 and 3 (ranks 0, 1)"),  # both model copies, each with both parts
])
def test_a_tied_embedding_is_summed_over_every_rank_holding_a_part_that_uses_it(make, parts, ranks, printed) -> None:
    plan = Plan.from_dict(json.loads(make()))
    (tied,) = plan.tied_sums
    assert (tied.parts, tied.nbytes) == (parts, EMBEDDING_BYTES)
    assert tied.ms == pytest.approx(_ring_ms(plan, ranks))
    assert f"tied: wte.weight summed over {printed} before each step: 256.0 KiB, " in str(plan)
    assert _runtime_tied(plan) == {tied.parts: tied.names} == {parts: ("wte.weight",)}
    assert plan.predicted.step_ms == simulate_plan(plan).step_ms
    assert simulate_plan(plan).step_ms > simulate_plan(dataclasses.replace(plan, tied_sums=())).step_ms
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


def test_a_replicated_stage_all_reduces_its_gradients_but_the_tied_weights_which_their_sum_carries() -> None:
    """Two replicas of two stages: each stage's data-parallel all-reduce is a ring over its 2 copies of its
    gradients less the embedding's (the runtime leaves tied weights out of it); the embedding's sum spans all 4
    ranks."""
    plan = Plan.from_dict(json.loads(make_plan(GPT, TWO, schedule="1f1b", data_parallel=2)))
    device = get_device("V100-16GB")
    for stage in plan.stages:
        ranks = list(plan.layout.part_ranks(stage.index))
        link = allreduce_link(device, ranks, plan.cluster.gpus_per_node)
        untied = ring_allreduce_ms(stage.predicted.grad_bytes - EMBEDDING_BYTES, len(ranks), link)
        assert len(ranks) == 2 and stage.predicted.allreduce_ms == pytest.approx(untied)
        assert stage.predicted.allreduce_ms < ring_allreduce_ms(stage.predicted.grad_bytes, 2, link)
    gems = Plan.from_dict(json.loads(scheduled(make_plan(GPT, TWO, schedule="gpipe"), "gems-master")))
    for stage in gems.stages:  # recosted over the mirrored copies, still without the embedding
        ranks = list(gems.layout.part_ranks(stage.index))
        link = allreduce_link(device, ranks, gems.cluster.gpus_per_node)
        assert stage.predicted.allreduce_ms == pytest.approx(
            ring_allreduce_ms(stage.predicted.grad_bytes - EMBEDDING_BYTES, len(ranks), link))


def test_parts_on_one_rank_share_the_weight_and_sum_nothing() -> None:
    """Four parts looped over two ranks: parts 0 and 3, which use the tied weight, are on ranks 0 and 1; looped
    over three ranks, parts 0 and 3 are both on rank 0."""
    four = make_plan(GPT, FOUR, schedule="gpipe")
    over_two, over_three = (Plan.from_dict(json.loads(looped(four, ranks))) for ranks in (2, 3))
    assert over_two.tied_sums[0].ms == pytest.approx(_ring_ms(over_two, [0, 1]))
    (tied,) = over_three.tied_sums
    assert (tied.parts, tied.ms) == ((0, 3), 0.0)
    assert "tied: wte.weight, one tensor on rank 0 for stages 0 and 3: no sum" in str(over_three)
    assert simulate_plan(over_three).step_ms == simulate_plan(dataclasses.replace(over_three, tied_sums=())).step_ms


def test_a_rank_holding_two_parts_that_use_a_tied_weight_counts_its_one_copy_once() -> None:
    """GEMS-MASTER puts part 0 of one model copy and part 1 of the other on each rank: both use the embedding, and the
    runtime keeps one tensor a rank (its earlier stage's: runtime/stages.py local_stages), so one copy of its
    weights, gradients and momentum (3 x 512 x 64 float64). The replay takes that copy off the later stage of each
    rank (stages 2 and 3: static bytes, and its gradients from its first backward on); a pipeline's ranks, one part
    each, keep theirs. Each rank's peak falls by at least the weights and momentum, at most the whole copy."""
    from planner.simulation import sim_costs

    copy_bytes = 3 * EMBEDDING_BYTES
    gems = Plan.from_dict(json.loads(scheduled(make_plan(GPT, TWO, schedule="gpipe"), "gems-master")))
    (tied,) = gems.tied_sums
    assert tied.state_bytes == copy_bytes
    assert [gems.layout.stages_of_rank(rank) for rank in (0, 1)] == [(0, 3), (1, 2)]

    def costs(plan: Plan, tied_sums: tuple) -> tuple:
        return sim_costs(plan.layout, plan.stages, plan.transfers, plan.schedule.kind, plan.cluster.backend,
                         tied_sums).stages

    counted, twice = costs(gems, gems.tied_sums), costs(gems, (dataclasses.replace(tied, state_bytes=0),))
    for stage, (once, both) in enumerate(zip(counted, twice)):
        taken = copy_bytes if stage in (2, 3) else 0
        assert (both.static_bytes - once.static_bytes, both.grad_bytes - once.grad_bytes) == (
            taken, EMBEDDING_BYTES if taken else 0)
    before = simulate_plan(dataclasses.replace(gems, tied_sums=(dataclasses.replace(tied, state_bytes=0),)))
    for rank, (now, then) in enumerate(zip(simulate_plan(gems).peak_mem_bytes, before.peak_mem_bytes)):
        assert copy_bytes - EMBEDDING_BYTES <= then - now <= copy_bytes, rank
    assert Plan.from_dict(json.loads(gems.to_json())) == gems
    pipeline = Plan.from_dict(json.loads(make_plan(GPT, TWO, schedule="gpipe")))
    assert pipeline.tied_sums[0].state_bytes == copy_bytes
    assert costs(pipeline, pipeline.tied_sums) == costs(pipeline, ())


@pytest.mark.parametrize("budget", [350, 349])
def test_the_searchs_rows_count_the_one_copy_a_rank_keeps_of_a_weight_its_first_and_last_parts_use(budget) -> None:
    """Two units of 100 and 200 bytes of state both using a weight of 50 (a tied embedding and head), on two parts
    mirrored as GEMS-MASTER lays them out: each rank runs the first part of one model copy and the last of the
    other, and keeps one tensor of the weight, 350 bytes in all, what it holds where only the first unit uses it.
    The evaluator and the ILP say so (350 fits, 349 does not); on a pipeline each part keeps its own copy."""
    from planner.plan import Layout, ScheduleKind
    from planner.search.evaluate import evaluate
    from planner.search.ilp import solve_partition
    from planner.search.problem import GPU_ONLY, LinearCost, PipelineProblem, SharedParam, Unit
    from planner.search.terms import cost_model

    def costs(users: tuple[int, ...], layout: Layout):
        units = tuple(Unit((name,), 1.0, 2.0, state, 0, 0, 0, shared=(0,) if index in users else ())
                      for index, (name, state) in enumerate((("a", 100), ("b", 200))))
        free = LinearCost(0.0, 0.0)
        return cost_model(PipelineProblem(units, (0,), (SharedParam("w", state_bytes=50, grad_bytes=10),), layout,
                                          ScheduleKind.GPIPE, 1, (1,) * layout.num_stages, (free,), (free, free),
                                          budget, GPU_ONLY))

    mirrored = costs((0, 1), Layout.mirrored(2))
    assert evaluate(mirrored, (0,)).slot_peak_bytes == evaluate(costs((0,), Layout.mirrored(2)), (0,)).slot_peak_bytes \
        == (350, 350)
    assert evaluate(costs((0, 1), Layout.pipeline(2)), (0,)).slot_peak_bytes == (150, 250)
    assert (solve_partition(mirrored).cuts is not None) is (budget >= 350)


def test_an_untied_split_and_a_tied_weight_within_one_part_sum_nothing() -> None:
    from examples.models.gpt import gpt
    from planner.manual import plan_with_split

    untied = plan_with_split(gpt(hidden=64, layers=2, heads=4, seq_len=32, vocab=512, tie_embeddings=False),
                             example_inputs=torch.empty(1, 32, dtype=torch.long, device="meta"),
                             stage_starts=TWO, batch_size=8, micro_batch_size=2, schedule="gpipe")
    assert untied.tied_sums == ()
    one_part = Plan.from_dict(json.loads(make_plan(GPT, [], schedule="gpipe", data_parallel=2)))
    assert one_part.tied_sums == ()
    assert _runtime_tied(one_part) == {}
