"""A plan whose spatial stage the search chose (plan(), not a hand-made split) runs and equals a
single-process float64 run: ResNet-50 (width 4, 64x64) on 3 ranks in 2 stages of 1 replica, which
only stage 0 on 2 tiles + 1 rank can use; wherever the ILP ends the tiles, GPipe and 1F1B.
"""

from __future__ import annotations

import json

import pytest
import torch

from cost_models.graph.model_spec import build_model, load_builder
from planner import plan
from planner.plan import Plan, Slicing
from runtime.build import default_dtype
from tests.dist.runtime_cases import Case
from tests.dist.test_spatial_runtime import _run
from tests.runtime_plans import RESNET

pytestmark = pytest.mark.dist


def _searched(schedule: str) -> str:
    kwargs = {"width": 4, "num_classes": 10}
    with default_dtype(torch.float64):
        model = build_model(load_builder(RESNET), kwargs, "meta")
    return plan(model, gpus=3, mem="16GB", batch_size=4, micro_batch_sizes=(2,), num_stages=(2,),
                data_parallel=(1,), schedules=(schedule,), precision="fp64", optimizer="momentum", offload=False,
                example_inputs=torch.empty(1, 3, 64, 64, dtype=torch.float64, device="meta"), builder=RESNET,
                builder_kwargs=kwargs).to_json()


def test_a_searched_spatial_plan_equals_a_single_process() -> None:
    plans = [_searched("gpipe"), _searched("1f1b")]
    for plan_json in plans:
        spatial = Plan.from_dict(json.loads(plan_json)).stages[0].spatial
        assert spatial is not None and (spatial.parts, spatial.slicing) == (2, Slicing.VERTICAL)
    _run([Case(plan_json, steps=1) for plan_json in plans], 3)
