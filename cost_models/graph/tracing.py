"""Capture a model as a LayerGraph: trace() measures it on fake tensors, rebuild_graph() does not."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Mapping, Sequence

import torch
import torch.fx
from torch import nn

from cost_models.errors import InvalidArgument, TraceError, describe_error
from cost_models.fake_measure import measure_graph
from cost_models.graph import node_info
from cost_models.graph.capture import Capture, LeafSpec, capture
from cost_models.graph.ir import LayerGraph, LayerNode, NodeKind, NodeWork, ParamInfo, TensorMeta
from cost_models.graph.shapes import crosses_boundary, dtype_name, node_outputs, propagate


def trace(model: nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor], *,
          leaf_modules: Sequence[LeafSpec] = ()) -> LayerGraph:
    """Trace ``model`` into a costed-ready LayerGraph without allocating its weights.

    ``example_inputs`` are tensors with the batch dimension first (only shapes and dtypes are
    used; meta tensors are fine). Standard torch.nn layers stay single nodes; ``leaf_modules``
    adds more (classes, class names or qualified submodule names).

    Example::

        model = resnet50(device="meta")
        g = trace(model, (torch.empty(8, 3, 224, 224, device="meta"),))
        print(len(g), g.param_count, g.fingerprint[:12])
    """
    return trace_module(model, normalise_inputs(example_inputs), leaf_modules)[0]


def trace_module(model: nn.Module, inputs: tuple[torch.Tensor, ...],
                 leaf_modules: Sequence[LeafSpec] = ()) -> tuple[LayerGraph, torch.fx.GraphModule]:
    """trace() that also returns the captured GraphModule (for profiling and splitting)."""
    captured = capture(model, inputs, leaf_modules)
    try:
        with _fake_errors_unlogged():
            measured = measure_graph(captured.module, inputs)
    except Exception as error:  # noqa: BLE001 - report which model failed and how to fix it
        raise _fake_run_failed(model, captured, inputs, error) from error
    outputs = {name: m.outputs for name, m in measured.items()}
    work = {name: NodeWork(m.fwd_flops, m.bwd_flops, m.saved_bytes_by_dtype, m.released_bytes_by_dtype,
                             m.freed_bytes_by_dtype)
            for name, m in measured.items()}
    staying = {name for name, m in measured.items() if not m.crosses}
    return build_graph(captured, outputs, work, staying), captured.module


def rebuild_graph(model: nn.Module, inputs: tuple[torch.Tensor, ...],
                  leaf_modules: Sequence[LeafSpec] = ()) -> tuple[LayerGraph, torch.fx.GraphModule]:
    """trace_module() without the costing: the same nodes and fingerprint, every NodeWork zero.

    For checking that a rebuilt model is the planned one: one fake shape-propagation run
    instead of measuring FLOPs and saved tensors node by node.

    Example::

        graph, traced = rebuild_graph(model, (torch.empty(2, 32, dtype=torch.long, device="meta"),))
        assert graph.fingerprint == plan.model.fingerprint
    """
    captured = capture(model, inputs, leaf_modules)
    try:
        with _fake_errors_unlogged():
            values = propagate(captured.module, inputs)
    except Exception as error:  # noqa: BLE001 - report which model failed and how to fix it
        raise _fake_run_failed(model, captured, inputs, error) from error
    staying = {name for name, value in values.items() if not crosses_boundary(value)}
    return build_graph(captured, node_outputs(captured.module, values), staying=staying), captured.module


@contextlib.contextmanager
def _fake_errors_unlogged() -> Iterator[None]:
    """torch's fake tensors log an op's failure with its whole traceback before raising it; the error
    :func:`_fake_run_failed` makes of it says what failed in one line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fake_run_failed(model: nn.Module, captured: Capture, inputs: tuple[torch.Tensor, ...],
                     error: Exception) -> TraceError:
    return TraceError(f"{type(model).__name__} was captured by {captured.tracer} but running it "
                      f"on fake tensors of shapes {[tuple(x.shape) for x in inputs]} failed: "
                      f"{describe_error(error)}. Check that the example inputs match "
                      f"what forward() expects, or mark the failing submodule as a leaf.")


def normalise_inputs(example_inputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    bad = [type(x).__name__ for x in inputs if not isinstance(x, torch.Tensor)]
    if not inputs or bad:
        raise InvalidArgument(f"example_inputs must be a tensor or a tuple of tensors (batch "
                              f"dimension first), got {bad or 'nothing'}; e.g. "
                              f"(torch.empty(8, 3, 224, 224, device='meta'),)")
    return inputs


def build_graph(captured: Capture, outputs: Mapping[str, tuple[TensorMeta, ...]],
                work: Mapping[str, NodeWork] | None = None, staying: Collection[str] = ()) -> LayerGraph:
    """Turn a captured GraphModule, each node's output tensors and (if measured) work into the IR.

    Nodes missing from ``work`` (all of them when it is None) get a zero NodeWork; nodes in ``staying`` make
    values that cannot cross a stage boundary (LayerNode.crosses).
    """
    module = captured.module
    canonical = _canonical_names(module)
    state_under = _state_by_module(canonical)
    shapes = {name: (metas[0].shape if metas else ()) for name, metas in outputs.items()}
    work = work or {}
    nodes = tuple(_layer_node(node, module, outputs[node.name], work.get(node.name, NodeWork()),
                              canonical, state_under, shapes, crosses=node.name not in staying)
                  for node in module.graph.nodes)
    return LayerGraph(nodes, _param_infos(module, nodes, canonical), captured.tracer)


def _layer_node(node: torch.fx.Node, module: torch.fx.GraphModule, outputs: tuple[TensorMeta, ...],
                work: NodeWork, canonical: dict[str, str], state_under: dict[str, list[str]],
                shapes: node_info.Shapes, *, crosses: bool) -> LayerNode:
    window = node_info.geometry(node, module, shapes)
    return LayerNode(
        name=node.name,
        kind=NodeKind(node.op),
        target=node_info.target_name(node),
        op_type=node_info.op_type(node, module),
        inputs=tuple(source.name for source in node.all_input_nodes),
        outputs=outputs,
        param_names=_params_used(node, canonical, state_under),
        geometry=window,
        spatially_splittable=node_info.spatially_splittable(node, module, window, outputs),
        work=work,
        crosses=crosses,
    )


def _canonical_names(module: nn.Module) -> dict[str, str]:
    """Every parameter/buffer name, tied aliases included, mapped to its first (canonical) name."""
    first: dict[int, str] = {}
    canonical: dict[str, str] = {}
    named = [*module.named_parameters(remove_duplicate=False),
             *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        canonical[name] = first.setdefault(id(tensor), name)
    return canonical


def _state_by_module(canonical: dict[str, str]) -> dict[str, list[str]]:
    """For every module path, the canonical names of the parameters and buffers under it.

    In the order that module's ``named_parameters()`` then ``named_buffers()`` (with
    ``remove_duplicate=False``) give them: ``canonical`` lists the whole model's that way, and
    a submodule's names are those under its path, in the same depth-first order. One pass
    here instead of walking every call_module node's submodule (about 30 us each).
    """
    under: dict[str, list[str]] = {}
    for name, first in canonical.items():
        path = name
        while "." in path:
            path = path.rpartition(".")[0]
            under.setdefault(path, []).append(first)
    return under


def _params_used(node: torch.fx.Node, canonical: dict[str, str],
                 state_under: dict[str, list[str]]) -> tuple[str, ...]:
    names: list[str] = []
    if node.op == "call_module":
        names = list(state_under.get(node.target, ()))
    elif node.op == "get_attr" and node.target in canonical:
        names = [canonical[node.target]]
    for source in node.all_input_nodes:
        if source.op == "get_attr" and source.target in canonical:
            names.append(canonical[source.target])
    return tuple(dict.fromkeys(names))


def _param_infos(module: nn.Module, nodes: tuple[LayerNode, ...],
                 canonical: dict[str, str]) -> tuple[ParamInfo, ...]:
    """Unique parameters and buffers, each owned by the first compute node that reads it."""
    owner: dict[str, str] = {}
    for node in nodes:
        if node.kind is not NodeKind.PARAM:
            for name in node.param_names:
                owner.setdefault(name, node.name)
    for node in nodes:  # read by nothing but its own get_attr node
        for name in node.param_names:
            owner.setdefault(name, node.name)
    tensors = dict([*module.named_parameters(), *module.named_buffers()])
    buffers = {name for name, _ in module.named_buffers()}
    aliases: dict[str, list[str]] = {}
    for alias, name in canonical.items():
        if alias != name:
            aliases.setdefault(name, []).append(alias)
    return tuple(ParamInfo(name, tuple(tensors[name].shape), dtype_name(tensors[name].dtype),
                           tensors[name].numel() * tensors[name].element_size(), name in buffers,
                           node_name, tuple(aliases.get(name, ())))
                 for name, node_name in owner.items())
