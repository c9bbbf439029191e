"""What crosses stages: sources, edges in graph order, values that travel, gradients that return."""

from __future__ import annotations

import json

import pytest
import torch

from planner.plan import Plan
from runtime.build import rebuild_model, split_stages, trace_checked
from runtime.dataflow import Dataflow, SourceKind, dataflow
from runtime.values import ValueKind, ValueSpec, value_specs
from tests.runtime_plans import GPT, RESNET, make_plan


def _flow(plan_json: str) -> Dataflow:
    plan = Plan.from_dict(json.loads(plan_json))
    model = rebuild_model(plan)
    traced = trace_checked(model, plan)
    modules = split_stages(traced, model, plan)
    inputs = [(m.shape, getattr(torch, m.dtype)) for m in plan.model.example_inputs]
    specs = value_specs(traced, inputs, plan.training.micro_batch_size)
    return dataflow(traced, modules, plan.part_of(), specs)


@pytest.fixture(scope="module")
def gpt_inside_attention() -> Dataflow:
    return _flow(make_plan(GPT, ["blocks_0_attn_qkv"], schedule="gpipe"))


def test_python_ints_travel_but_carry_no_gradient(gpt_inside_attention: Dataflow) -> None:
    flow = gpt_inside_attention
    travelling = flow.travelling((0, 1))
    kinds = {name: flow.specs[name].kind for name in travelling}
    assert ValueKind.INT in kinds.values() and ValueKind.TENSOR in kinds.values()
    assert all(flow.specs[name].kind is ValueKind.TENSOR for name in flow.gradients((0, 1)))
    assert set(flow.gradients((0, 1))) < set(travelling)


def test_the_tied_head_reads_its_own_copy_and_inputs_enter_on_stage_0(gpt_inside_attention: Dataflow) -> None:
    flow = gpt_inside_attention
    last = flow.stages[flow.last_stage]
    assert any(s.kind is SourceKind.PARAM and s.target == "wte.weight" for s in last.sources.values())
    assert flow.data_inputs == ("idx",) and flow.data_stage == 0
    assert flow.specs["blocks_0_ln_1"].shape == (2, 32, 64)  # micro-batch 2, not the traced batch 1


def test_a_skip_goes_straight_to_a_non_adjacent_stage_in_graph_order() -> None:
    flow = _flow(make_plan(RESNET, ["layer2_0_conv2", "layer2_0_conv3", "layer3_0_conv1"], schedule="1f1b"))
    assert flow.edges[(0, 2)] == ("layer1_2_relu3",)  # the block input, read by the shortcut
    assert set(flow.edges) == {(0, 1), (0, 2), (1, 2), (2, 3)}
    assert flow.producers(2) == (0, 1) and flow.consumers(0) == (1, 2)


@pytest.mark.parametrize("spec, value", [
    (ValueSpec("n", ValueKind.INT), 7),
    (ValueSpec("x", ValueKind.FLOAT), 0.25),
    (ValueSpec("b", ValueKind.BOOL), True),
    (ValueSpec("s", ValueKind.INTS, (3,)), torch.Size([2, 3, 4])),
])
def test_scalars_and_sizes_round_trip_through_tensors(spec: ValueSpec, value: object) -> None:
    wire = spec.encode(value, torch.device("cpu"))
    buffer = spec.empty(torch.device("cpu"))
    assert buffer.shape == wire.shape and buffer.dtype == wire.dtype
    assert spec.decode(wire, torch.device("cpu")) == value


def test_a_device_is_the_receivers_own_and_a_wrong_shape_is_refused() -> None:
    device = ValueSpec("d", ValueKind.CONSTANT, constant=torch.device("meta"))
    assert not device.travels and device.decode(None, torch.device("cpu")) == torch.device("cpu")
    tensor = ValueSpec("t", ValueKind.TENSOR, (2, 3), torch.float32, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"\(2, 3\)"):
        tensor.encode(torch.zeros(4, 3), torch.device("cpu"))


def test_describing_a_real_model_leaves_its_buffers_as_they_were() -> None:
    from cost_models.graph.tracing import trace_module
    from examples.models.resnet import resnet50

    model = resnet50(width=4, num_classes=10, device="cpu")
    _, traced = trace_module(model, (torch.randn(1, 3, 64, 64),))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    value_specs(traced, [((1, 3, 64, 64), torch.float32)], 2)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_the_plans_transfer_bytes_are_the_runtimes_wire_bytes_python_ints_included() -> None:
    """Cut inside attention, GPT's head count and sizes cross as Python ints: the plan's transfer counts each
    as the int64 tensor the runtime sends, and its gradient bytes only the values whose gradient returns."""
    plan = Plan.from_dict(json.loads(make_plan(GPT, ["blocks_0_attn_qkv"], schedule="gpipe")))
    flow = _flow(plan.to_json())
    wire = {name: flow.specs[name].empty(torch.device("cpu")) for name in flow.travelling((0, 1))}
    assert any(flow.specs[name].kind is not ValueKind.TENSOR for name in wire)  # ints do cross this cut
    [transfer] = plan.transfers
    assert transfer.nbytes == sum(t.numel() * t.element_size() for t in wire.values())
    assert transfer.grad_nbytes == sum(wire[name].numel() * wire[name].element_size()
                                       for name in flow.gradients((0, 1)))
    assert transfer.grad_nbytes < transfer.nbytes


def test_each_wire_tensor_is_a_message_whose_post_the_plan_costs_both_ends() -> None:
    """A link that costs 100 us to post on: the plan's transfer costs each end one post per tensor the
    runtime sends, and its predicted step pays them (the simulator's own arithmetic: test_schedule_simulate)."""
    import dataclasses

    from cost_models.devices import get_device
    from planner.simulation import simulate_plan

    base = get_device("V100-16GB")
    posting = dataclasses.replace(base, intra_node=dataclasses.replace(base.intra_node, post_us=100.0))
    free, paid = (Plan.from_dict(json.loads(make_plan(GPT, ["blocks_0_attn_qkv"], schedule="1f1b", device=device)))
                  for device in (base, posting))
    wire = _flow(paid.to_json()).travelling((0, 1))
    [transfer] = paid.transfers
    assert len(wire) > 1 and transfer.post_ms == pytest.approx(len(wire) * 0.1)
    assert free.transfers[0].post_ms == 0.0
    assert paid.predicted.step_ms == pytest.approx(simulate_plan(paid).step_ms)
    assert paid.predicted.step_ms > free.predicted.step_ms + transfer.post_ms  # the last backward's wait at least
