"""rebuild_graph: the traced graph without costing it; the runtime's plan check measures nothing."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import pytest
import torch
from torch import nn

from cost_models.graph.ir import LayerGraph, NodeWork
from cost_models.graph.shapes import propagate
from cost_models.graph.tracing import rebuild_graph, trace
from examples.models.amoebanet import amoebanet_d
from examples.models.bert import bert_tiny
from examples.models.gpt import gpt_tiny
from examples.models.resnet import resnet50
from examples.models.unet import unet_small
from planner.plan import Plan
from runtime.build import rebuild_model, trace_checked
from tests.runtime_plans import GPT, RESNET, make_plan
from tests.unit.test_trace import Gate, ShapeBranch, Stem, ValueBranch


def _tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.empty(batch, seq, dtype=torch.long, device="meta")


def _image(batch: int, size: int) -> torch.Tensor:
    return torch.empty(batch, 3, size, size, device="meta")


# (model builder, example input, leaf modules): zoo models on meta, plus the export fallback
# and a value-dependent leaf (run on zeros) from test_trace.
CASES: dict[str, tuple[Callable[[], nn.Module], torch.Tensor, tuple[type, ...]]] = {
    "gpt_tiny": (gpt_tiny, _tokens(2, 32), ()),
    "bert_tiny": (bert_tiny, _tokens(2, 32), ()),
    "resnet50_w8": (lambda: resnet50(width=8, num_classes=10), _image(2, 64), ()),
    "amoebanet_small": (lambda: amoebanet_d(num_layers=3, num_filters=16, num_classes=10), _image(2, 64), ()),
    "unet_small": (unet_small, _image(2, 64), ()),
    "stem_real_weights": (Stem, torch.randn(2, 3, 32, 32), ()),
    "export_fallback": (lambda: ShapeBranch().to("meta"), torch.empty(4, 16, device="meta"), ()),
    "value_dependent_leaf": (lambda: ValueBranch().to("meta"), torch.empty(4, 8, device="meta"), (Gate,)),
}


def _unmeasured(graph: LayerGraph) -> LayerGraph:
    return dataclasses.replace(graph, nodes=tuple(dataclasses.replace(node, work=NodeWork())
                                                  for node in graph.nodes))


@pytest.mark.parametrize("case", sorted(CASES))
def test_rebuilt_graph_is_the_traced_graph_without_work(case: str) -> None:
    build, example, leaves = CASES[case]
    traced = trace(build(), example, leaf_modules=leaves)
    rebuilt, module = rebuild_graph(build(), (example,), leaves)
    assert rebuilt.fingerprint == traced.fingerprint
    assert [node.name for node in rebuilt] == [node.name for node in module.graph.nodes]
    for mine, theirs in zip(rebuilt, traced, strict=True):
        assert [(m.shape, m.dtype, m.nbytes) for m in mine.outputs] == \
            [(m.shape, m.dtype, m.nbytes) for m in theirs.outputs], mine.name
        assert mine.work == NodeWork(), mine.name
    assert rebuilt == _unmeasured(traced)  # geometry, splittability, params and owners too


def test_propagation_leaves_real_buffers_and_weights_untouched() -> None:
    model = resnet50(width=4, num_classes=10, device="cpu")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    _, module = rebuild_graph(model, (torch.randn(2, 3, 32, 32),))
    values = propagate(module, (torch.empty(3, 3, 32, 32, device="meta"),))
    assert values["fc"].shape == (3, 10) and values["fc"].requires_grad
    assert not values["x"].requires_grad
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def _refuse_to_measure(*args: object, **kwargs: object) -> None:
    raise AssertionError("the runtime's plan check must not measure the model")


@pytest.mark.parametrize("builder, stage_starts", [(GPT, ["blocks_0_attn_qkv"]),
                                                   (RESNET, ["layer2_0_conv1"])])
def test_the_runtime_checks_the_plan_without_measuring(monkeypatch: pytest.MonkeyPatch, builder: str,
                                                       stage_starts: list[str]) -> None:
    plan = Plan.from_dict(json.loads(make_plan(builder, stage_starts, schedule="gpipe")))
    monkeypatch.setattr("cost_models.fake_measure.measure_graph", _refuse_to_measure)
    monkeypatch.setattr("cost_models.graph.tracing.measure_graph", _refuse_to_measure)
    traced = trace_checked(rebuild_model(plan), plan)
    assert {node.name for node in traced.graph.nodes} == set(plan.part_of())
