"""Unmodified Hugging Face models, planned by plan() and run on 2 ranks, equal a single process.

GPT-2 and BERT (masked LM) built from tiny configurations (no downloads), in float64, with
dropout 0 (the reference draws no per-stage masks). fx cannot trace them; they are captured by
torch.export with a symbolic batch dimension, planned at a batch of 1 and run at micro-batches
of 2. The reference is the eager model, whose ModelOutput's logits the loss reads; each rank's
losses, gradients and parameters after 2 steps must equal it at the float64 tolerance of
tests/dist/test_runtime.py. The planner picks the cut itself (2 stages, 1F1B).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.runtime_cases import Case, check_outcomes, reference, run_cases

pytestmark = pytest.mark.dist

GPT2 = ("transformers:GPT2LMHeadModel",
        {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100, "n_positions": 32,
         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
BERT = ("transformers:BertForMaskedLM",
        {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
         "vocab_size": 100, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
         "attention_probs_dropout_prob": 0.0})


def _planned(builder: str, kwargs: dict[str, Any]) -> str:
    from cost_models.graph.model_spec import build_model, load_builder
    from planner import plan
    from runtime.build import default_dtype

    with default_dtype(torch.float64):
        model = build_model(load_builder(builder), kwargs, "meta")
        return plan(model, gpus=2, mem="16GB", batch_size=4, micro_batch_sizes=(2,), num_stages=(2,),
                    schedules=("1f1b",), precision="fp64", optimizer="momentum", builder=builder,
                    builder_kwargs=kwargs, example_inputs=torch.empty(1, 16, dtype=torch.long, device="meta"),
                    ).to_json()


def test_hugging_face_gpt2_and_bert_equal_a_single_process() -> None:
    cases = [Case(_planned(*GPT2), steps=2), Case(_planned(*BERT), steps=2)]
    outcomes = run_ranks(run_cases, 2, cases, timeout_s=180)
    for index, case in enumerate(cases):
        check_outcomes(reference(case, lambda output: output.logits), case,
                       [outcomes[rank][index] for rank in range(2)])
