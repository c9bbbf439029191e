"""Hugging Face models on the meta device: captured without their no-grad regions, and initialised
with the buffers their own constructors compute (not zeros).

The references are independent of tessera: the model built by its constructor on the CPU (its
non-persistent buffers), and the eager model's output.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cost_models.errors import TraceError
from cost_models.graph.capture import capture
from cost_models.graph.model_spec import build_model, load_builder
from runtime.weights import initialize

LLAMA = ("transformers:LlamaForCausalLM",
         {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
          "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 32})
BERT = ("transformers:BertForMaskedLM",
        {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
         "vocab_size": 100, "max_position_embeddings": 32})


def _non_persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{path}.{name}" if path else name: module._buffers[name]
            for path, module in model.named_modules() for name in module._non_persistent_buffers_set}


@pytest.mark.parametrize("spec", [LLAMA, BERT], ids=["llama", "bert"])
def test_non_persistent_buffers_are_the_constructors_values(spec: tuple[str, dict]) -> None:
    builder, kwargs = spec
    expected = _non_persistent_buffers(build_model(load_builder(builder), kwargs, "cpu"))
    assert expected, "the model must have non-persistent buffers for this test to mean anything"
    got = _non_persistent_buffers(initialize(build_model(load_builder(builder), kwargs, "meta"), seed=3))
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].device.type == "cpu", name
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"buffer {name}")
    assert any(value.count_nonzero() for value in expected.values())  # zeros would have failed


def test_llama_no_grad_rotary_region_is_inlined_and_equals_eager() -> None:
    builder, kwargs = LLAMA
    model = initialize(build_model(load_builder(builder), kwargs, "meta"), seed=3).double()
    tokens = torch.randint(0, 100, (3, 16))
    graph = capture(model, (tokens[:1],)).module
    hops = [node for node in graph.graph.nodes
            if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)]
    assert not hops and not any(name.startswith("submod") for name, _ in graph.named_children())
    torch.testing.assert_close(graph(tokens), model(tokens).logits, rtol=1e-12, atol=1e-12)


class _Regions(nn.Module):
    """fx cannot trace it (int() of a proxy); export wraps its two regions as higher-order ops."""

    def __init__(self, autocast: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.autocast = autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(int(x.shape[0] > 0)):
            x = x * 3
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            y = self.lin(x)
        with torch.no_grad():
            z = y * 2
        return y.float().relu() * z.float()


def test_no_grad_region_outputs_carry_no_gradient_like_eager() -> None:
    model = _Regions(autocast=False).double()
    captured = capture(model, (torch.empty(1, 8, dtype=torch.float64),))
    assert captured.tracer == "export"
    x = torch.randn(3, 8, dtype=torch.float64)
    expected = torch.autograd.grad(model(x).sum(), model.lin.weight)[0]
    got = torch.autograd.grad(captured.module(x).sum(), model.lin.weight)[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_an_enabled_autocast_region_is_refused_in_one_line() -> None:
    with pytest.raises(TraceError) as refused:
        capture(_Regions(autocast=True), (torch.empty(2, 8),))
    message = str(refused.value)
    assert message.count("\n") == 0 and message.startswith("cannot capture _Regions: ")
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in message and "precision to plan()" in message
