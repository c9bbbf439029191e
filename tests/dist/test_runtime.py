"""The runtime equals a single-process float64 run: losses, every gradient, every parameter.

2 ranks: GPT (tied embedding across stages; one cut inside attention so Python ints cross
stages) under GPipe and 1F1B, with SGD-momentum and once with Adam, and once given real
weights instead of a meta model; ResNet-50 (width 4) cut
inside a residual block so the block's input crosses to the next stage; the GPT and the ResNet in
4 stages looped over 2 ranks (stages 0 and 2 on rank 0, so the ResNet's skip is handed over in
memory), as interleaved schedules place them. 4 ranks:
the ResNet in 4 stages with a skip from stage 0 to stage 2, and the GPT as 2 stages x 2 replicas,
also from a plan file of schema 1 (written before the layout existed).

Recompute and swap, as plans name them (OffloadSpec): checkpoint regions, swapped nodes and both,
on 2 ranks under GPipe and 1F1B and on 4 ranks (ResNet in 4 stages, GPT as 2 stages x 2 replicas):
regions across a residual add, a whole stage as one region, batch-norm inside regions (its running
statistics must equal the reference's: updated once per forward), the tied LM head's swapped
input. Dropout is 0 here (the reference draws no per-stage masks); tests/unit/test_offload.py
checks that recomputation replays dropout.
"""

from __future__ import annotations

import json

import pytest

from planner.plan import OffloadSpec, Plan
from tests.dist.harness import run_ranks
from tests.dist.runtime_cases import Case, Outcome, check_outcomes, reference, run_cases
from tests.runtime_plans import GPT, RESNET, ROOT, looped, make_plan

pytestmark = pytest.mark.dist

FOUR_GPT_STAGES = ["blocks_0_ln_2", "blocks_1_ln_1", "blocks_1_ln_2"]
SKIP_TO_STAGE_2 = ["layer2_0_conv2", "layer2_0_conv3", "layer3_0_conv1"]  # block input 0 -> 2
GPT_MLP_0 = ("blocks_0_ln_2", "blocks_0_mlp_fc", "blocks_0_mlp_gelu")
GPT_ATTENTION_1 = ("blocks_1_attn_qkv", "split_1", "getitem_3", "getitem_4", "getitem_5", "view_3",
                   "transpose_4", "view_4", "transpose_5", "view_5", "transpose_6",
                   "scaled_dot_product_attention_1", "transpose_7", "reshape_1", "blocks_1_attn_proj")
RESNET_STEM = ("conv1", "bn1", "relu")
RESNET_RESIDUAL_2_0 = ("layer2_0_bn3", "layer2_0_shortcut_0", "layer2_0_shortcut_1", "add_3")


def _check(case: Case, by_rank: list[Outcome]) -> None:
    check_outcomes(reference(case), case, by_rank)


def test_two_rank_pipelines_equal_a_single_process() -> None:
    cases = [Case(make_plan(GPT, ["blocks_1_ln_1"], schedule="gpipe")),
             Case(make_plan(GPT, ["blocks_1_ln_1"], schedule="gpipe"), real_weights=True),
             Case(make_plan(GPT, ["blocks_0_attn_qkv"], schedule="1f1b")),
             Case(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", optimizer="adam"), lr=1e-3),
             Case(make_plan(RESNET, ["layer2_0_conv2"], schedule="gpipe")),
             Case(make_plan(RESNET, ["layer2_0_conv2"], schedule="1f1b")),
             Case(looped(make_plan(GPT, FOUR_GPT_STAGES, schedule="gpipe"), ranks=2)),
             Case(looped(make_plan(RESNET, SKIP_TO_STAGE_2, schedule="gpipe"), ranks=2))]
    outcomes = run_ranks(run_cases, 2, cases, timeout_s=180)
    for index, case in enumerate(cases):
        _check(case, [outcomes[rank][index] for rank in range(2)])


def test_four_rank_pipelines_and_data_parallel_equal_a_single_process() -> None:
    cases = [Case(make_plan(RESNET, SKIP_TO_STAGE_2, schedule="gpipe")),
             Case(make_plan(RESNET, SKIP_TO_STAGE_2, schedule="1f1b")),
             Case(make_plan(GPT, ["blocks_1_ln_1"], schedule="gpipe", data_parallel=2, microbatches=2)),
             Case(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", data_parallel=2, microbatches=3)),
             Case((ROOT / "tests" / "data" / "plan_v1_gpt_tiny_2x2.json").read_text())]
    outcomes = run_ranks(run_cases, 4, cases, timeout_s=300)
    for index, case in enumerate(cases):
        _check(case, [outcomes[rank][index] for rank in range(4)])


def _check_offloaded(case: Case, by_rank: list[Outcome]) -> None:
    """Each rank ran its stages' checkpoint regions checkpointed and swapped bytes iff they swap."""
    plan = Plan.from_dict(json.loads(case.plan_json))
    for rank, outcome in enumerate(by_rank):
        specs = [plan.stages[plan.layout.part(stage)].offload for stage in plan.layout.stages_of_rank(rank)]
        assert outcome.checkpointed == sum(len(spec.recompute) for spec in specs), f"rank {rank}"
        assert (outcome.swapped_bytes > 0) == any(spec.swap for spec in specs), f"rank {rank}"


def _gpt_offload(recompute: bool, swap: bool) -> list[OffloadSpec]:
    return [OffloadSpec(recompute=(GPT_MLP_0,) if recompute else (),
                        swap=("blocks_0_attn_qkv", "blocks_0_mlp_proj") if swap else ()),
            OffloadSpec(recompute=(GPT_ATTENTION_1, ("add_4", "ln_f")) if recompute else (),
                        swap=("blocks_1_mlp_fc", "blocks_1_mlp_gelu", "linear") if swap else ())]


def test_two_rank_recompute_and_swap_equal_a_single_process() -> None:
    resnet = [OffloadSpec(recompute=(RESNET_STEM, ("layer1_0_conv1", "layer1_0_bn1", "layer1_0_relu1"))),
              OffloadSpec(recompute=(RESNET_RESIDUAL_2_0,), swap=("layer2_1_conv1", "layer2_1_bn1"))]
    resnet_swapped = [OffloadSpec(swap=("layer1_1_conv2", "layer1_1_bn2", "layer1_1_relu2")),
                      OffloadSpec(recompute=(("layer2_0_conv2", "layer2_0_bn2", "layer2_0_relu2"),),
                                  swap=RESNET_RESIDUAL_2_0)]
    cases = [Case(make_plan(GPT, ["blocks_1_ln_1"], schedule="gpipe", offload=_gpt_offload(True, False))),
             Case(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", offload=_gpt_offload(False, True))),
             Case(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", offload=_gpt_offload(True, True))),
             Case(make_plan(RESNET, ["layer2_0_conv2"], schedule="gpipe", offload=resnet)),
             Case(make_plan(RESNET, ["layer2_0_conv2"], schedule="1f1b", offload=resnet_swapped))]
    outcomes = run_ranks(run_cases, 2, cases, timeout_s=180)
    for index, case in enumerate(cases):
        _check(case, [outcomes[rank][index] for rank in range(2)])
        _check_offloaded(case, [outcomes[rank][index] for rank in range(2)])


def test_four_rank_recompute_and_swap_equal_a_single_process() -> None:
    resnet = [OffloadSpec(recompute=(RESNET_STEM,), swap=("layer1_0_conv1", "layer1_0_bn1")),
              OffloadSpec(recompute=(("layer2_0_conv2", "layer2_0_bn2", "layer2_0_relu2"),)),  # the whole stage
              OffloadSpec(recompute=(("layer2_0_conv3", "layer2_0_bn3"),), swap=("add_3", "layer2_0_relu3")),
              OffloadSpec(swap=("layer3_0_conv1", "layer3_0_bn1"))]
    cases = [Case(make_plan(RESNET, SKIP_TO_STAGE_2, schedule="1f1b", offload=resnet)),
             Case(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", data_parallel=2, microbatches=3,
                            offload=_gpt_offload(True, True)))]
    outcomes = run_ranks(run_cases, 4, cases, timeout_s=300)
    for index, case in enumerate(cases):
        _check(case, [outcomes[rank][index] for rank in range(4)])
        _check_offloaded(case, [outcomes[rank][index] for rank in range(4)])
