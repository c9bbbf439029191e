"""Every synchronous schedule family, as its generator writes it, equals a single-process float64 run.

Plans are cut by hand (tests/runtime_plans.py) and re-scheduled through ``generate()``, lowered and
validated by the planner's passes; the runtime interprets the programs. The tiny GPT ties its
embedding (first stage) to the LM head (last stage), and the cuts below start a stage at
``blocks_0_mlp_proj`` after two short ones, so the residual stream skips from the stage holding
``add_1`` over two stages (across ranks) to the one adding it back. Losses, every gradient and every
final weight are compared at rtol 1e-10, on 2 and on 4 ranks, for interleaved-1f1b (v = 2 and 3),
zb-h1 (on 2 ranks also with a recomputed region, and with swapped activations, on its second stage) and
gems-master.
"""

from __future__ import annotations

import pytest

from planner.plan import OffloadSpec
from tests.dist.harness import run_ranks
from tests.dist.runtime_cases import Case, run_cases
from tests.dist.test_runtime import _check, _check_offloaded
from tests.runtime_plans import GPT, make_plan, scheduled

pytestmark = pytest.mark.dist

GPT_4 = ["blocks_0_ln_2", "blocks_0_mlp_fc", "blocks_0_mlp_proj"]  # add_1: stage 0 -> 3
GPT_6 = ["blocks_0_ln_2", "blocks_0_mlp_fc", "blocks_0_mlp_proj", "blocks_1_ln_1", "blocks_1_ln_2"]  # 0 -> 3
GPT_8 = ["blocks_0_attn_qkv", "blocks_0_ln_2", "blocks_0_mlp_fc", "blocks_0_mlp_proj", "blocks_1_ln_1",
         "blocks_1_attn_qkv", "blocks_1_ln_2"]  # add_1: stage 1 -> 4
GPT_12 = ["blocks_0_ln_1", "blocks_0_attn_qkv", "blocks_0_attn_proj", "blocks_0_ln_2", "blocks_0_mlp_fc",
          "blocks_0_mlp_proj", "blocks_1_ln_1", "blocks_1_attn_qkv", "blocks_1_attn_proj", "blocks_1_ln_2",
          "blocks_1_mlp_fc"]  # add_1: stage 3 -> 6


# the second stage recomputes its last block's MLP (a split backward's I and W each backpropagate through
# it), or swaps what its MLP saves (held on the device from its SWAP_IN until its W, not its I)
MLP_RECOMPUTED = [OffloadSpec(),
                  OffloadSpec(recompute=(("blocks_1_mlp_fc", "blocks_1_mlp_gelu", "blocks_1_mlp_proj"),))]
MLP_SWAPPED = [OffloadSpec(), OffloadSpec(swap=("blocks_1_mlp_fc", "blocks_1_mlp_gelu", "blocks_1_mlp_proj"))]


def _case(builder: str, starts: list[str], kind: str, microbatches: int, offload: list[OffloadSpec] | None = None,
          **options: object) -> Case:
    return Case(scheduled(make_plan(builder, starts, schedule="gpipe", microbatches=microbatches,
                                    micro_batch_size=1, offload=offload), kind, **options), steps=2)


def _run(cases: list[Case], ranks: int) -> None:
    outcomes = run_ranks(run_cases, ranks, cases, timeout_s=240)
    for index, case in enumerate(cases):
        _check(case, [outcomes[rank][index] for rank in range(ranks)])
        _check_offloaded(case, [outcomes[rank][index] for rank in range(ranks)])  # regions ran, bytes swapped


def test_two_ranks() -> None:
    _run([_case(GPT, GPT_4, "interleaved-1f1b", 2, virtual_stages=2),
          _case(GPT, GPT_6, "interleaved-1f1b", 2, virtual_stages=3),
          _case(GPT, ["blocks_1_ln_1"], "zb-h1", 3),
          _case(GPT, ["blocks_1_ln_1"], "zb-h1", 3, offload=MLP_RECOMPUTED),
          _case(GPT, ["blocks_1_ln_1"], "zb-h1", 3, offload=MLP_SWAPPED),
          _case(GPT, ["blocks_1_ln_1"], "gems-master", 4)], 2)


def test_four_ranks() -> None:
    _run([_case(GPT, GPT_8, "interleaved-1f1b", 4, virtual_stages=2),
          _case(GPT, GPT_12, "interleaved-1f1b", 4, virtual_stages=3),
          _case(GPT, GPT_4, "zb-h1", 5),
          _case(GPT, GPT_4, "gems-master", 4)], 4)
