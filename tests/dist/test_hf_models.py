"""Unmodified Hugging Face models, planned by plan() and run on 2 ranks, equal a single process.

GPT-2, BERT (masked LM), Llama (causal LM: rotary embedding in a no-grad region, grouped-query
attention, RMSNorm) and ViT (image classification) built from tiny configurations (no
downloads), in float64, with dropout 0 (the reference draws no per-stage masks). fx cannot trace them; they are captured by
torch.export with a symbolic batch dimension, planned at a batch of 1 and run at micro-batches
of 2. The reference is the eager model, whose ModelOutput's logits the loss reads; each rank's
losses, gradients and parameters after 2 steps must equal it at the float64 tolerance of
tests/dist/test_runtime.py. The planner picks the cut itself (2 stages, 1F1B).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
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


LLAMA = ("transformers:LlamaForCausalLM",
         {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
          "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 32})
VIT = ("transformers:ViTForImageClassification",
       {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
        "image_size": 16, "patch_size": 4, "num_labels": 10, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0})
TOKENS = torch.empty(1, 16, dtype=torch.long, device="meta")
IMAGES = torch.empty(1, 3, 16, 16, dtype=torch.float64, device="meta")


def _planned(builder: str, kwargs: dict[str, Any], example: torch.Tensor = TOKENS) -> str:
    from cost_models.graph.model_spec import build_model, load_builder
    from planner import plan
    from runtime.build import default_dtype

    with default_dtype(torch.float64):
        model = build_model(load_builder(builder), kwargs, "meta")
        return plan(model, gpus=2, mem="16GB", batch_size=4, micro_batch_sizes=(2,), num_stages=(2,),
                    schedules=("1f1b",), precision="fp64", optimizer="momentum", builder=builder,
                    builder_kwargs=kwargs, example_inputs=example,
                    ).to_json()


def test_hugging_face_gpt2_bert_llama_and_vit_equal_a_single_process() -> None:
    cases = [Case(_planned(*GPT2), steps=2), Case(_planned(*BERT), steps=2),
             Case(_planned(*LLAMA), steps=2), Case(_planned(*VIT, IMAGES), steps=2)]
    outcomes = run_ranks(run_cases, 2, cases, timeout_s=240)
    for index, (case, (builder, kwargs)) in enumerate(zip(cases, (GPT2, BERT, LLAMA, VIT))):
        expected = reference(case, lambda output: output.logits)
        _check_constructor_buffers(builder, kwargs, expected.buffers)
        expected.buffers = {name: value for name, value in expected.buffers.items()
                            if name in _buffers_read(case)}  # Llama's original_inv_freq is not
        check_outcomes(expected, case, [outcomes[rank][index] for rank in range(2)])


def _buffers_read(case: Case) -> set[str]:
    """The buffers the captured graph reads: those the ranks' stages hold."""
    from planner.plan import Plan
    from runtime.build import rebuild_model, trace_checked

    plan = Plan.from_dict(json.loads(case.plan_json))
    traced = trace_checked(rebuild_model(plan), plan)
    buffers = {name for name, _ in traced.named_buffers()}
    return {node.target for node in traced.graph.nodes if node.op == "get_attr" and node.target in buffers}


def _check_constructor_buffers(builder: str, kwargs: dict[str, Any], buffers: dict[str, Any]) -> None:
    """The run's non-persistent buffers (BERT's position_ids, Llama's inv_freq) are what the model's
    constructor computes on the CPU, not the zeros a meta tensor would be replaced by."""
    from cost_models.graph.model_spec import build_model, load_builder
    from runtime.build import default_dtype

    with default_dtype(torch.float64):
        model = build_model(load_builder(builder), kwargs, "cpu")
    for name, value in model.named_buffers():
        np.testing.assert_array_equal(buffers[name], value.numpy(), err_msg=f"{builder} buffer {name}")
