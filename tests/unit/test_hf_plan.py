"""`tessera plan transformers:<ModelClass>`: a Hugging Face model built from its configuration on the
meta device (no download), planned, rebuilt as the runtime does and run at the micro-batch size; a
configuration field it does not know is one error line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.cli import main
from planner.plan import Plan
from runtime.build import rebuild_model, trace_checked
from runtime.data import input_specs
from runtime.values import value_specs

GPT2_ARGS = ["--model-arg", "n_layer=4", "--model-arg", "n_embd=32", "--model-arg", "n_head=2",
             "--model-arg", "vocab_size=100", "--model-arg", "n_positions=32"]
PLAN = ["--input", "32:int64", "--batch-size", "8", "--gpus", "2", "--mem", "1GB", "-q"]


def test_a_transformers_model_class_plans_from_its_config(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    output = ["-o", str(tmp_path / "plan.json")]
    assert main(["plan", "transformers:GPT2LMHeadModel", *GPT2_ARGS, *PLAN, *output]) == 0
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.model.builder == "transformers:GPT2LMHeadModel" and plan.model.builder_kwargs["n_layer"] == 4
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=32))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head once
    assert sum(stage.predicted.param_bytes for stage in plan.stages) == param_bytes
    traced = trace_checked(rebuild_model(plan), plan)  # the runtime's rebuild: the planned graph again
    micro = plan.training.micro_batch_size
    specs = value_specs(traced, [((1, 32), torch.int64)], micro)  # traced at 1, run at the micro-batch
    output = next(node for node in traced.graph.nodes if node.op == "output").args[0].name
    assert specs[output].shape == (micro, 32, 100)
    assert [spec.high for spec in input_specs(traced, specs)] == [100]  # token ids below the vocabulary


def test_an_unknown_config_field_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "transformers:GPT2LMHeadModel", "--model-arg", "n_layr=4", *PLAN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GPT2Config has no field 'n_layr'" in err, err
    assert "did you mean 'n_layer'?" in err
