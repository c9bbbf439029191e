"""cost_models.estimate: model-state bytes by optimizer and precision, roofline times, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from cost_models import CostTable, estimate, get_device
from cost_models.devices import LinkSpec
from planner import trace
from cost_models.errors import InvalidArgument


def _linear_graph(batch: int = 4):
    model = nn.Sequential(nn.Linear(100, 50), nn.ReLU())
    return trace(model, torch.empty(batch, 100, device="meta"))


@pytest.mark.parametrize(("optimizer", "precision", "param", "grad", "state"), [
    ("sgd", "fp32", 4, 4, 0),
    ("momentum", "fp32", 4, 4, 4),
    ("adam", "fp32", 4, 4, 8),
    ("adamw", "fp16", 2, 2, 4 + 8),  # fp32 master weights + two fp32 moments
    ("adam", "bf16", 2, 2, 12),
    ("sgd", "fp64", 8, 8, 0),
])
def test_model_state_bytes_per_parameter(optimizer: str, precision: str, param: int, grad: int,
                                         state: int) -> None:
    numel = 100 * 50 + 50
    cost = estimate(_linear_graph(), "A100-80GB", optimizer, precision)["_0"]
    assert (cost.param_bytes, cost.grad_bytes, cost.optimizer_bytes) == (
        numel * param, numel * grad, numel * state)


def test_adam_mixed_precision_is_sixteen_bytes_per_parameter() -> None:
    graph = _linear_graph()
    table = estimate(graph, "A100-80GB", "adam", "bf16")
    state = table.total("param_bytes") + table.total("grad_bytes") + table.total("optimizer_bytes")
    assert state == 16 * graph.param_count


def test_activations_rescale_with_precision() -> None:
    graph = _linear_graph(batch=8)
    fp32 = estimate(graph, "A100-80GB", "adam", "fp32")
    bf16 = estimate(graph, "A100-80GB", "adam", "bf16")
    source = graph.input_nodes[0].name  # the linear saves its input: counted where it is allocated
    assert fp32[source].saved_activation_bytes == 8 * 100 * 4
    assert bf16.total("saved_activation_bytes") * 2 == fp32.total("saved_activation_bytes")
    assert bf16["_0"].output_bytes * 2 == fp32["_0"].output_bytes


def test_a_saved_tensor_is_kept_by_its_maker_and_released_by_its_last_saver() -> None:
    """Linear -> GELU -> Linear on 8 x 64 fp32 inputs, hand-computed: the first Linear saves the input
    (2048 bytes), the GELU the first Linear's output (8 x 256 x 4 = 8192), the second Linear the GELU's
    output (8192). Each is held with the node that made it; recomputing a node releases what it saves:
    recomputing the GELU alone keeps its own output, which the second Linear still saves."""
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    graph = trace(model, torch.empty(8, 64, device="meta"))
    table = estimate(graph, "A100-80GB", "sgd", "fp32")
    source = graph.input_nodes[0].name
    rows = {name: (table[name].saved_activation_bytes, table[name].released_activation_bytes)
            for name in (source, "_0", "_1", "_2")}
    assert rows == {source: (2048, 0), "_0": (8192, 2048), "_1": (8192, 8192), "_2": (0, 8192)}
    assert table.total("saved_activation_bytes") == sum(cost.released_activation_bytes for cost in table.costs)


def _toy_device(tflops: float, gb_per_s: float, overhead_us: float = 0.0):
    link = LinkSpec("toy-link", 10.0, 1.0)
    return dataclasses.replace(get_device("V100-16GB"), name="toy", fp32_tflops=tflops,
                               mem_bandwidth_gb_per_s=gb_per_s, matmul_efficiency=1.0,
                               memory_efficiency=1.0, kernel_overhead_us=overhead_us,
                               intra_node=link)


def test_roofline_times_by_hand() -> None:
    graph = _linear_graph(batch=4)
    linear_flops = 2 * 4 * 100 * 50
    assert graph.node("_0").work.fwd_flops == linear_flops
    assert graph.node("_0").work.bwd_flops == linear_flops  # grad of weight only; input needs none
    compute_bound = estimate(graph, _toy_device(tflops=1e-6, gb_per_s=1e6))
    assert compute_bound["_0"].fwd_ms == pytest.approx(linear_flops / 1e6 * 1e3)
    traffic = (4 * 100 + 4 * 50 + 100 * 50 + 50) * 4  # input + output + weights, fp32
    memory_bound = estimate(graph, _toy_device(tflops=1e6, gb_per_s=1e-3, overhead_us=7.0))
    assert memory_bound["_0"].fwd_ms == pytest.approx(traffic / 1e6 * 1e3 + 7e-3)
    assert memory_bound["_0"].bwd_ms == pytest.approx(2 * traffic / 1e6 * 1e3 + 7e-3)
    relu = memory_bound["_1"]
    assert relu.fwd_ms == pytest.approx(2 * 4 * 50 * 4 / 1e6 * 1e3 + 7e-3)


def test_the_output_node_costs_the_training_loss_by_hand() -> None:
    """The last stage runs the loss after the model: a memory-bound pass over the logits each way
    (read them, write as much), five operations per element."""
    model = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 32))
    graph = trace(model, torch.zeros(2, 16, dtype=torch.long, device="meta"))  # logits (2, 16, 32)
    logits_bytes, elements = 2 * 16 * 32 * 4, 2 * 16 * 32
    memory_bound = estimate(graph, _toy_device(tflops=1e6, gb_per_s=1e-3, overhead_us=7.0))
    assert memory_bound["output"].fwd_ms == pytest.approx(2 * logits_bytes / 1e6 * 1e3 + 7e-3)
    assert memory_bound["output"].bwd_ms == pytest.approx(4 * logits_bytes / 1e6 * 1e3 + 7e-3)
    compute_bound = estimate(graph, _toy_device(tflops=1e-6, gb_per_s=1e6))
    assert compute_bound["output"].fwd_ms == pytest.approx(5 * elements / 1e6 * 1e3)
    doubled = estimate(graph, _toy_device(tflops=1e6, gb_per_s=1e-3), batch_size=4)
    assert doubled["output"].fwd_ms == pytest.approx(2 * memory_bound["output"].fwd_ms, rel=1e-3)


def test_custom_device_from_json(tmp_path) -> None:
    from cost_models.devices import save_device

    path = tmp_path / "toy.json"
    save_device(_toy_device(tflops=2.0, gb_per_s=100.0), path)
    table = estimate(_linear_graph(), str(path))
    assert table.device == "toy" and table["_0"].fwd_ms > 0


def test_cost_table_round_trip(tmp_path) -> None:
    table = estimate(_linear_graph(), "H100-80GB", "adam", "bf16")
    table.save(tmp_path / "costs.json")
    assert CostTable.load(tmp_path / "costs.json") == table
    assert list(table) == [node.name for node in _linear_graph()]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device": "T4"}, "T4"),
    ({"optimizer": "lamb"}, "lamb"),
    ({"precision": "fp8"}, "fp8"),
    ({"device": "V100-16GB", "precision": "bf16"}, "bf16"),
])
def test_bad_arguments_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        estimate(_linear_graph(), **kwargs)


def test_batch_size_rescales_activations_and_flops_but_not_weights() -> None:
    graph = _linear_graph(batch=4)
    base = estimate(graph, "A100-80GB")
    double = estimate(graph, "A100-80GB", batch_size=8)
    assert double["_0"].fwd_flops == 2 * base["_0"].fwd_flops
    assert double.total("saved_activation_bytes") == 2 * base.total("saved_activation_bytes")
    assert double["_0"].output_bytes == 2 * base["_0"].output_bytes
    assert double["_0"].param_bytes == base["_0"].param_bytes
    traced_at_8 = estimate(trace(nn.Sequential(nn.Linear(100, 50), nn.ReLU()),
                                 torch.empty(8, 100, device="meta")), "A100-80GB")
    assert traced_at_8.costs == double.costs  # linear layers scale exactly
