"""Predicted memory and FLOPs against independent measurements on real CPU tensors."""

from __future__ import annotations

import gc
from typing import Any, Callable

import pytest
import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from cost_models import estimate
from examples.models.amoebanet import amoebanet_d
from examples.models.gpt import gpt_tiny
from examples.models.resnet import resnet50
from examples.models.wrn import wrn
from cost_models.graph.tracing import trace_module


class _StorageRecorder(TorchDispatchMode):
    """Remembers, for every storage an aten op returns, which fx node ran first with it."""

    def __init__(self) -> None:
        super().__init__()
        self.node = "<none>"
        self.created: dict[int, tuple[str, int, StorageWeakRef]] = {}

    def note(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        known = self.created.get(key)
        if key and (known is None or known[2].expired()):  # the allocator reuses freed addresses
            self.created[key] = (self.node, storage.nbytes(), StorageWeakRef(storage))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor):
                self.note(leaf)
        return output


class _RecordingInterpreter(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, recorder: _StorageRecorder) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.recorder = recorder

    def run_node(self, node: torch.fx.Node) -> Any:
        self.recorder.node = node.name
        value = super().run_node(node)
        if node.op == "placeholder":  # the input copy below is this node's allocation
            value = value.clone()
            self.recorder.note(value)
        return value


def live_bytes_after_forward(module: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...],
                             param_keys: set[int]) -> dict[str, int]:
    """Bytes per producing node that are still alive after a real forward (autograd holds them)."""
    recorder = _StorageRecorder()
    with recorder:
        output = _RecordingInterpreter(module, recorder).run(*inputs)
    loss = sum(t.float().sum() for t in tree_leaves(output) if isinstance(t, torch.Tensor))
    del output
    gc.collect()
    alive: dict[str, int] = {}
    for key, (node, nbytes, ref) in recorder.created.items():
        if not ref.expired() and key not in param_keys:
            alive[node] = alive.get(node, 0) + nbytes
    assert loss.requires_grad
    return alive


def _param_keys(model: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}


CASES: dict[str, Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]] = {
    "resnet50": lambda: (resnet50(device="cpu"), (torch.randn(2, 3, 32, 32),)),
    "gpt": lambda: (gpt_tiny(device="cpu"), (torch.randint(0, 512, (2, 32)),)),
    "wrn": lambda: (wrn(depth=16, widen_factor=4, dropout=0.3, device="cpu"),
                    (torch.randn(2, 3, 32, 32),)),
    "amoebanet": lambda: (amoebanet_d(num_layers=3, num_filters=16, num_classes=10, device="cpu"),
                          (torch.randn(2, 3, 64, 64),)),
}


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, inputs = CASES[request.param]()
    return request.param, model, inputs


def test_saved_activation_bytes_match_live_storages(case: tuple) -> None:
    name, model, inputs = case
    graph, module = trace_module(model, inputs)
    measured = live_bytes_after_forward(module, inputs, _param_keys(model))
    predicted = {node.name: node.work.saved_bytes for node in graph if node.work.saved_bytes}
    assert set(predicted) == set(measured), f"{name}: nodes differ"
    for node_name, nbytes in measured.items():
        assert predicted[node_name] == pytest.approx(nbytes, rel=0.05), node_name
    total = estimate(graph, device="V100-16GB").total("saved_activation_bytes")
    assert total == pytest.approx(sum(measured.values()), rel=0.05)
    assert total > 0


def test_parameter_bytes_are_exact(case: tuple) -> None:
    _, model, inputs = case
    graph, _ = trace_module(model, inputs)
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    table = estimate(graph, device="V100-16GB", optimizer="adam", precision="fp32")
    assert table.total("param_bytes") == expected == graph.param_bytes
    assert table.total("grad_bytes") == expected
    assert table.total("optimizer_bytes") == 2 * expected


def test_flops_equal_flop_counter_on_real_forward_backward(case: tuple) -> None:
    """Against the math path of attention, whose matmuls torch's counter sees (its fused CPU kernel
    counted nothing, so attention was free before cost_models.fake_measure.flop_counter), plus what
    the fused backward does on top: it recomputes the scores Q K^T (2 B H L^2 D per attention)."""
    _, model, inputs = case
    graph, _ = trace_module(model, inputs)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        output = model(*inputs)
        output.float().sum().backward()
    recompute = 0
    for node in graph:
        if "scaled_dot_product_attention" in node.target:
            batch, heads, length, head_dim = graph.node(node.inputs[0]).output_shape
            recompute += 2 * batch * heads * length * length * head_dim
    predicted = sum(node.work.fwd_flops + node.work.bwd_flops for node in graph)
    assert predicted == counter.get_total_flops() + recompute > 0
    assert (recompute > 0) == (case[0] == "gpt")


def test_attention_costs_torchs_sdpa_formula() -> None:
    """4 B H L^2 D forward (QK^T and attention x V) on the fused CPU kernel the fake run dispatches to."""
    from examples.models.gpt import gpt

    graph, _ = trace_module(gpt(hidden=64, layers=1, heads=4, seq_len=128, vocab=100, dropout=0.0),
                            (torch.zeros(2, 128, dtype=torch.long),))
    (attention,) = [node for node in graph if "scaled_dot_product_attention" in node.target]
    batch, heads, length, head_dim = graph.node(attention.inputs[0]).output_shape
    assert (batch, heads, length, head_dim) == (2, 4, 128, 16)
    assert attention.work.fwd_flops == 4 * batch * heads * length * length * head_dim
    assert attention.work.bwd_flops == 10 * batch * heads * length * length * head_dim
