"""Which values each stage takes, from where, and what it sends to which stage, per micro-batch.

A value produced on stage s and consumed on stage d is sent directly from s to d (skip
connections to non-adjacent stages included), in the order its producing nodes appear in the
graph. Model inputs enter on the stage that holds the input placeholders (stage 0), the model
output is read on the last stage (where the loss is computed), and parameters read through
``get_attr`` (e.g. a tied LM head) are taken from the stage's own copy, never sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch.fx

from cost_models.errors import RuntimeSetupError
from runtime.values import ValueSpec, check_travels

Edge = tuple[int, int]  # (src stage, dst stage)


class SourceKind(str, Enum):
    DATA = "data"  # a model input on the stage that owns the placeholders
    STAGE = "stage"  # produced by another stage (sent, or handed over on the same rank)
    PARAM = "param"  # a get_attr tensor: the stage's own copy of a (possibly tied) parameter


@dataclass(frozen=True)
class Source:
    kind: SourceKind
    stage: int = -1  # producing stage (STAGE)
    index: int = -1  # model input position (DATA)
    target: str = ""  # attribute path in the model (PARAM)


@dataclass(frozen=True)
class StageIO:
    """The stage submodule's positional inputs (with their sources) and its outputs."""

    stage: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    sources: Mapping[str, Source]


@dataclass(frozen=True)
class Dataflow:
    """Per stage inputs/outputs, the values on every stage-to-stage edge, and value specs."""

    stages: tuple[StageIO, ...]
    edges: Mapping[Edge, tuple[str, ...]]  # values sent per micro-batch, in graph order
    data_inputs: tuple[str, ...]  # model input placeholders, in forward() order
    data_stage: int  # the stage that holds them (where the inputs enter)
    output: Any  # the model output with node names in place of values
    output_names: tuple[str, ...]
    specs: Mapping[str, ValueSpec]

    @property
    def last_stage(self) -> int:
        return len(self.stages) - 1

    def travelling(self, edge: Edge) -> tuple[str, ...]:
        """Values on ``edge`` that are actually transmitted (constants are not)."""
        return tuple(name for name in self.edges.get(edge, ()) if self.specs[name].travels)

    def gradients(self, edge: Edge) -> tuple[str, ...]:
        """Values on ``edge`` whose gradient travels back from dst to src."""
        return tuple(name for name in self.edges.get(edge, ()) if self.specs[name].carries_grad)

    def consumers(self, stage: int) -> tuple[int, ...]:
        return tuple(sorted(dst for src, dst in self.edges if src == stage))

    def producers(self, stage: int) -> tuple[int, ...]:
        return tuple(sorted(src for src, dst in self.edges if dst == stage))


def dataflow(traced: torch.fx.GraphModule, stage_modules: Mapping[int, torch.fx.GraphModule],
             stage_of: Mapping[str, int], specs: Mapping[str, ValueSpec]) -> Dataflow:
    """Derive the dataflow from the traced graph and the split_module submodules."""
    nodes = {node.name: node for node in traced.graph.nodes}
    order = {name: position for position, name in enumerate(nodes)}
    data_inputs = tuple(name for name, node in nodes.items() if node.op == "placeholder")
    output_node = next(node for node in traced.graph.nodes if node.op == "output")
    output = torch.fx.graph.map_arg(output_node.args[0], lambda node: node.name)
    output_names = tuple(node.name for node in output_node.all_input_nodes)
    stages = tuple(_stage_io(stage, stage_modules[stage], nodes, stage_of, data_inputs)
                   for stage in range(len(stage_modules)))
    edges: dict[Edge, set[str]] = {}
    for io in stages:
        for name, source in io.sources.items():
            if source.kind is SourceKind.STAGE:
                edges.setdefault((source.stage, io.stage), set()).add(name)
    last = len(stages) - 1
    for name in output_names:
        if stage_of[name] != last and nodes[name].op != "get_attr":
            edges.setdefault((stage_of[name], last), set()).add(name)
    for (src, dst), names in edges.items():
        for name in names:
            check_travels(specs[name], src, dst)
    ordered = {edge: tuple(sorted(names, key=order.__getitem__)) for edge, names in sorted(edges.items())}
    return Dataflow(stages, ordered, data_inputs, stage_of[data_inputs[0]] if data_inputs else 0,
                    output, output_names, dict(specs))


def _stage_io(stage: int, module: torch.fx.GraphModule, nodes: Mapping[str, torch.fx.Node],
              stage_of: Mapping[str, int], data_inputs: tuple[str, ...]) -> StageIO:
    inputs = tuple(node.name for node in module.graph.nodes if node.op == "placeholder")
    output_node = next(node for node in module.graph.nodes if node.op == "output")
    outputs = tuple(node.name for node in output_node.all_input_nodes)
    sources = {name: _source(name, stage, nodes, stage_of, data_inputs) for name in inputs}
    return StageIO(stage, inputs, outputs, sources)


def _source(name: str, stage: int, nodes: Mapping[str, torch.fx.Node], stage_of: Mapping[str, int],
            data_inputs: tuple[str, ...]) -> Source:
    node = nodes.get(name)
    if node is None:
        raise RuntimeSetupError(f"stage {stage}'s submodule takes {name!r}, which is not a node of "
                                f"the traced model; re-plan the model")
    if node.op == "get_attr":
        return Source(SourceKind.PARAM, target=str(node.target))
    if node.op == "placeholder" and stage_of[name] == stage:
        return Source(SourceKind.DATA, index=data_inputs.index(name))
    return Source(SourceKind.STAGE, stage=stage_of[name])


def check_edges(flow: Dataflow, planned: set[Edge]) -> None:
    """Every edge the model needs must be one the plan's programs communicate over."""
    missing = sorted(edge for edge in flow.edges if edge not in planned and flow.travelling(edge))
    if missing:
        raise RuntimeSetupError(f"the model sends values over stage edges {missing} but the plan's "
                                f"transfers only cover {sorted(planned)}; the plan does not match "
                                f"this model's graph: re-create it with `tessera plan`")
