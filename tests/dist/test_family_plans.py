"""Plans whose schedule family the search chose (``plan(..., schedules=(family,))``, not a hand-made
split) run and equal a single-process float64 run: interleaved 1F1B, ZB-H1 and GEMS-MASTER on the tiny
GPT (its embedding tied to the LM head across stages) on 2 and 4 ranks, with room to spare and, for
interleaved 1F1B on 2 ranks, under a budget that makes the search recompute on ranks holding several
parts (the least it reports needing with recompute: 6% under the least without, on this GPT).
"""

from __future__ import annotations

import json

import pytest

from planner.plan import Plan
from tests.dist.harness import run_ranks
from tests.dist.runtime_cases import Case, run_cases
from tests.dist.test_runtime import _check
from tests.runtime_plans import GPT, searched_plan

pytestmark = pytest.mark.dist

FAMILIES = ("interleaved-1f1b", "zb-h1", "gems-master")


def _cases(ranks: int) -> list[Case]:
    cases = [Case(searched_plan(GPT, gpus=ranks, budget_share=4.0, offload=(), schedule=family, batch_size=8,
                                micro_batch_size=2), steps=2) for family in FAMILIES]
    if ranks == 2:
        cases.append(Case(searched_plan(GPT, gpus=ranks, tightest=True, offload=("recompute",),
                                        schedule="interleaved-1f1b", batch_size=8, micro_batch_size=2), steps=2))
        tight = Plan.from_dict(json.loads(cases[-1].plan_json))
        assert any(stage.offload.recompute for stage in tight.stages), "the tight budget should make it recompute"
    for case, family in zip(cases, (*FAMILIES, "interleaved-1f1b")):
        searched = Plan.from_dict(json.loads(case.plan_json))
        assert searched.schedule.kind.value == family and searched.layout.world_size == ranks
    return cases


@pytest.mark.parametrize("ranks", [2, 4])
def test_searched_family_plans_equal_a_single_process(ranks: int) -> None:
    cases = _cases(ranks)
    outcomes = run_ranks(run_cases, ranks, cases, timeout_s=240)
    for index, case in enumerate(cases):
        _check(case, [outcomes[rank][index] for rank in range(ranks)])
