"""planner.trace: nodes, parameters, geometry, fingerprints, leaves, the export fallback, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from examples.models.gpt import gpt_tiny
from examples.models.resnet import resnet50
from planner import LayerGraph, NodeKind, trace
from cost_models.errors import InvalidArgument, TraceError


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 5, stride=2, padding=3, dilation=2, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.proj = nn.Conv2d(8, 8, 1)
        self.weight = nn.Parameter(torch.randn(4, 8, 3, 3))
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(torch.relu(self.bn(self.conv(x))))
        y = y + self.proj(y)
        y = F.conv2d(y, self.weight, stride=1, padding=2, dilation=2)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def test_nodes_are_topological_with_shapes_and_params() -> None:
    graph = trace(Stem(), torch.randn(2, 3, 32, 32))
    names = [node.name for node in graph]
    assert names[0] == "x" and graph.nodes[-1].kind is NodeKind.OUTPUT
    for index, node in enumerate(graph):
        assert all(names.index(source) < index for source in node.inputs)
    assert graph.node("conv").output_shape == (2, 8, 15, 15)  # (32 + 2*3 - 2*4 - 1) // 2 + 1
    assert graph.node("pool").output_shape == (2, 8, 8, 8)
    assert graph.node("conv").param_names == ("conv.weight",)
    assert graph.node("conv2d").param_names == ("weight",)
    assert graph.node("conv").outputs[0].nbytes == 2 * 8 * 15 * 15 * 4
    assert graph.param_count == sum(p.numel() for p in Stem().parameters())


def test_geometry_and_spatial_splittability() -> None:
    graph = trace(Stem(), torch.randn(2, 3, 32, 32))
    conv = graph.node("conv").geometry
    assert (conv.op, conv.kernel, conv.stride, conv.padding, conv.dilation) == (
        "conv", (5, 5), (2, 2), (3, 3), (2, 2))
    pool = graph.node("pool").geometry
    assert (pool.op, pool.kernel, pool.stride, pool.padding) == ("max_pool", (3, 3), (2, 2), (1, 1))
    functional = graph.node("conv2d").geometry
    assert (functional.kernel, functional.padding, functional.dilation) == ((3, 3), (2, 2), (2, 2))
    assert graph.node("proj").geometry.kernel == (1, 1)
    splittable = {node.name for node in graph if node.spatially_splittable}
    assert {"conv", "bn", "relu", "pool", "proj", "add", "conv2d"} <= splittable
    assert not {"adaptive_avg_pool2d", "flatten", "fc"} & splittable


def test_tied_parameters_are_counted_once() -> None:
    model = gpt_tiny()
    graph = trace(model, torch.empty(2, 32, dtype=torch.long, device="meta"))
    unique = sum(p.numel() for p in model.parameters())
    assert graph.param_count == unique
    wte = graph.parameter("wte.weight")
    users = [node.name for node in graph if "wte.weight" in node.param_names]
    assert len(users) >= 2 and wte.owner == users[0]
    assert graph.owned_param_bytes[users[-1]] == 0


def test_fingerprint_is_stable_and_shape_sensitive() -> None:
    a = trace(resnet50(width=8), torch.empty(2, 3, 64, 64, device="meta"))
    b = trace(resnet50(width=8), torch.empty(2, 3, 64, 64, device="meta"))
    c = trace(resnet50(width=8), torch.empty(4, 3, 64, 64, device="meta"))
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a == b


def test_round_trip_and_networkx_view() -> None:
    graph = trace(Stem(), torch.randn(2, 3, 32, 32))
    assert LayerGraph.from_dict(graph.to_dict()) == graph
    view = graph.to_networkx()
    assert view.number_of_nodes() == len(graph)
    assert view.has_edge("bn", "relu") and view.edges["conv", "bn"]["nbytes"] == 2 * 8 * 15 * 15 * 4
    tampered = graph.to_dict()
    tampered["nodes"][1]["target"] = "other"
    with pytest.raises(ValueError, match="fingerprint"):
        LayerGraph.from_dict(tampered)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.second = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


@pytest.mark.parametrize("leaf", [Block, "Block", "first"])
def test_leaf_modules_stay_single_nodes(leaf: type | str) -> None:
    graph = trace(TwoBlocks(), torch.randn(4, 8), leaf_modules=[leaf])
    ops = [node.op_type for node in graph if node.kind is NodeKind.MODULE]
    assert ops.count("Block") == (1 if leaf == "first" else 2)
    block = next(node for node in graph if node.op_type == "Block")
    assert block.work.fwd_flops == 2 * 2 * 4 * 8 * 8
    assert len(block.param_names) == 4


def test_unknown_leaf_name_is_an_error() -> None:
    with pytest.raises(TraceError, match="'thrid'"):
        trace(TwoBlocks(), torch.randn(4, 8), leaf_modules=["thrid"])


class ShapeBranch(nn.Module):
    """Control flow on a shape: fx cannot trace it, torch.export specialises it."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(16, 32)
        self.narrow = nn.Linear(16, 4)
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:
            return self.out(torch.relu(self.wide(x)))
        return self.narrow(x)


def test_shape_dependent_control_flow_falls_back_to_export() -> None:
    model = ShapeBranch()
    x = torch.randn(4, 16)
    graph = trace(model, x)
    assert graph.tracer == "export"
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert sum(n.work.fwd_flops + n.work.bwd_flops for n in graph) == counter.get_total_flops()
    assert graph.param_count == 16 * 32 + 32 + 32 * 3 + 3  # only the branch taken
    meta = ShapeBranch().to("meta")
    assert trace(meta, torch.empty(4, 16, device="meta")).fingerprint == graph.fingerprint


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(x))


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # depends on values: neither tracer can capture it
            return self.inner(x)
        return x


def test_value_dependent_control_flow_raises_a_clear_error() -> None:
    with pytest.raises(TraceError) as error:
        trace(ValueBranch(), torch.randn(4, 8))
    message = str(error.value)
    assert "ValueBranch" in message and "torch.fx" in message and "torch.export" in message
    assert "leaf_modules" in message


def test_marking_the_branching_module_as_leaf_fixes_it() -> None:
    graph = trace(ValueBranch(), torch.randn(4, 8), leaf_modules=["Gate"])
    assert graph.tracer == "fx" and graph.node("gate").op_type == "Gate"


def test_inputs_must_be_tensors() -> None:
    with pytest.raises(InvalidArgument, match="tuple of tensors"):
        trace(Stem(), [3, 32, 32])


def test_value_dependent_leaf_on_meta_is_measured_on_zeros() -> None:
    model = ValueBranch().to("meta")
    graph = trace(model, torch.empty(4, 8, device="meta"), leaf_modules=[Gate])
    assert graph.node("gate").outputs[0].shape == (4, 8)
    assert graph.node("head").work.fwd_flops == 2 * 4 * 8 * 2


def test_an_untraceable_model_prints_nothing_and_keeps_torch_output_as_details(capfd) -> None:
    """torch.export dumps its partial graph on stderr when it fails; plan() prints nothing of it."""
    from planner import plan

    with pytest.raises(TraceError) as error:
        plan(ValueBranch(), gpus=2, mem="1GB", batch_size=4, example_inputs=torch.randn(1, 8))
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""
    assert "def forward" in error.value.details and "x.sum() > 0" in error.value.details
