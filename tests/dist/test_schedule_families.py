"""Every synchronous schedule family, as its generator writes it, equals a single-process float64 run.

Plans are cut by hand (tests/runtime_plans.py) and re-scheduled through ``generate()``, lowered and
validated by the planner's passes; the runtime interprets the programs. The GPT ties its embedding
to the LM head (first and last stage) and, cut at ``blocks_0_ln_2 | blocks_0_mlp_fc``, sends the
residual stream from stage 0 straight to stage 2; the ResNet cut ``SKIP_TO_STAGE_2`` sends a block's
input from stage 0 to stage 2. Losses, every gradient and every final weight are compared at rtol 1e-10.
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks
from tests.dist.runtime_cases import Case, run_cases
from tests.dist.test_runtime import SKIP_TO_STAGE_2, _check
from tests.runtime_plans import GPT, RESNET, make_plan, scheduled

pytestmark = pytest.mark.dist

GPT_6 = ["blocks_0_ln_2", "blocks_0_mlp_fc", "blocks_1_ln_1", "blocks_1_ln_2", "blocks_1_mlp_fc"]  # skip 0 -> 2
GPT_8 = ["blocks_0_attn_qkv", "blocks_0_ln_2", "blocks_0_mlp_fc", "blocks_1_ln_1", "blocks_1_attn_qkv",
         "blocks_1_ln_2", "blocks_1_mlp_fc"]  # skip 1 -> 3 (rank 1 to rank 3)


def _case(builder: str, starts: list[str], kind: str, microbatches: int, **options: object) -> Case:
    return Case(scheduled(make_plan(builder, starts, schedule="gpipe", microbatches=microbatches,
                                    micro_batch_size=1), kind, **options), steps=2)


def _run(cases: list[Case], ranks: int) -> None:
    outcomes = run_ranks(run_cases, ranks, cases, timeout_s=240)
    for index, case in enumerate(cases):
        _check(case, [outcomes[rank][index] for rank in range(ranks)])


def test_two_ranks() -> None:
    _run([_case(GPT, GPT_6, "interleaved-1f1b", 4, virtual_stages=3),
          _case(RESNET, SKIP_TO_STAGE_2, "interleaved-1f1b", 2, virtual_stages=2),
          _case(GPT, ["blocks_1_ln_1"], "zb-h1", 3),
          _case(GPT, ["blocks_1_ln_1"], "gems-master", 4)], 2)


def test_four_ranks() -> None:
    _run([_case(GPT, GPT_8, "interleaved-1f1b", 4, virtual_stages=2),
          _case(RESNET, SKIP_TO_STAGE_2, "zb-h1", 5),
          _case(RESNET, SKIP_TO_STAGE_2, "gems-master", 2)], 4)
