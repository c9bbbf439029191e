"""A checkpoint of a 2-rank GPT pipeline (its embedding tied to its head across the two stages) resumed by the
same split interleaved on one rank, whose optimizers step the tied weight once: refused in one line naming the
stage, not torch's ValueError in a traceback per rank."""

from __future__ import annotations

import json
from pathlib import Path

from tests.dist.harness import run_ranks
from tests.runtime_plans import GPT, make_plan


def _train(rank: int, world_size: int, plan_json: str, directory: str, steps: int, resume: bool) -> str:
    import torch

    from cost_models.errors import CheckpointError
    from planner.plan import Plan
    from runtime.train import RunOptions, run

    plan = Plan.from_dict(json.loads(plan_json))
    options = RunOptions(plan=Path("-"), steps=steps, checkpoint_dir=Path(directory), checkpoint_every=1,
                         resume=resume, timeout_s=60)
    try:
        run(plan, options, torch.device("cpu"))
    except CheckpointError as error:
        return str(error)
    return "ran"


def test_a_checkpoint_resumed_by_a_plan_that_holds_its_weights_otherwise_is_refused_in_one_line(
        tmp_path: Path) -> None:
    from planner.manual import reschedule
    from planner.plan import Plan

    pipeline = make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b")  # gpt_tiny ties its embedding and head
    assert run_ranks(_train, 2, pipeline, str(tmp_path), 2, False, timeout_s=120) == ["ran", "ran"]
    interleaved = reschedule(Plan.from_dict(json.loads(pipeline)), "interleaved-1f1b", virtual_stages=2)
    (said,) = run_ranks(_train, 1, interleaved.to_json(), str(tmp_path), 4, True, timeout_s=120)
    assert said.startswith("stage ") and "optimizer state was written for another plan" in said, said
    assert "resume with the plan that wrote it" in said and "\n" not in said
