"""Capture a model as a torch.fx GraphModule: symbolic tracing first, torch.export as fallback."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import operator
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from cost_models.errors import TraceError, describe_error

LeafSpec = type | str
"""A leaf module: a class, a class name (``"MyBlock"``) or a qualified submodule name (``"encoder.3"``)."""


@dataclass(frozen=True)
class Capture:
    """A captured graph and how it was obtained."""

    module: torch.fx.GraphModule
    tracer: str  # "fx" or "export"


class LeafTracer(torch.fx.Tracer):
    """fx tracer that keeps standard torch.nn layers, and the user's leaf modules, as single nodes."""

    def __init__(self, leaf_modules: Sequence[LeafSpec] = ()) -> None:
        super().__init__()
        self.leaf_types = tuple(spec for spec in leaf_modules if isinstance(spec, type))
        self.leaf_names = frozenset(spec for spec in leaf_modules if isinstance(spec, str))

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if (qualified_name in self.leaf_names or type(module).__name__ in self.leaf_names
                or isinstance(module, self.leaf_types)):
            return True
        return super().is_leaf_module(module, qualified_name)


def check_leaf_specs(model: nn.Module, leaf_modules: Sequence[LeafSpec]) -> None:
    """Reject leaf specs that name no submodule, so a typo does not silently change the graph."""
    names = set()
    for name, module in model.named_modules():
        names.update((name, type(module).__name__))
    for spec in leaf_modules:
        if isinstance(spec, str) and spec not in names:
            raise TraceError(f"leaf module {spec!r} is neither a submodule name nor a module class "
                             f"name in {type(model).__name__}; give a qualified name from "
                             f"model.named_modules(), a class name, or a module class")
        if not isinstance(spec, (str, type)):
            raise TraceError(f"leaf module {spec!r} must be a module class or a qualified name")


def capture(model: nn.Module, example_inputs: tuple[torch.Tensor, ...],
            leaf_modules: Sequence[LeafSpec] = ()) -> Capture:
    """Trace ``model`` with torch.fx, falling back to torch.export; raise TraceError if both fail.

    What torch prints or logs during the fallback (a failed export dumps its partial graph) is
    kept out of the user's terminal: in ``TraceError.details`` when both fail, dropped otherwise.
    """
    check_leaf_specs(model, leaf_modules)
    try:
        return Capture(_symbolic_trace(model, leaf_modules), "fx")
    except Exception as fx_error:  # noqa: BLE001 - any tracing failure sends us to the fallback
        with _captured_torch_output() as output:
            try:
                return Capture(_export(model, example_inputs), "export")
            except TraceError as refused:  # exported, but holding what tessera cannot plan
                raise TraceError(f"cannot capture {type(model).__name__}: {refused}") from refused
            except Exception as export_error:  # noqa: BLE001
                raise TraceError(_both_failed_message(model, fx_error, export_error),
                                 details=output.getvalue()) from export_error


def _symbolic_trace(model: nn.Module, leaf_modules: Sequence[LeafSpec]) -> torch.fx.GraphModule:
    tracer = LeafTracer(leaf_modules)
    graph = tracer.trace(model)
    name = type(model).__name__
    return torch.fx.GraphModule(tracer.root, graph, name)


def _export(model: nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> torch.fx.GraphModule:
    """torch.export with the batch dimension symbolic, as a GraphModule returning plain values.

    The runtime runs the planned graph at the plan's micro-batch size, not the example's, so the
    batch dimension must not be baked in (a reshape to ``[2, 32, 192]`` fails at batch 4). It is
    exported as ``Dim.AUTO``: symbolic wherever the model allows, one graph for every batch size
    and the same node names at plan and run time (capturing again at the micro-batch size would
    give another graph, another fingerprint and costs of a graph that is not the one planned). A
    batch of 1 would be specialised (torch.export treats sizes 0 and 1 as constants), so a batch
    of 1 is exported at 2. The pytree output (e.g. a Hugging Face ``ModelOutput``) is flattened:
    the graph returns its one tensor, or the tuple of its tensors in the output's field order.

    The model is exported on the meta device (a copy of its modules, not of its weights): an
    exported graph records strides, so it depends on the device's kernels (after CPU attention a
    ``.contiguous()`` is a no-op and vanishes, after meta attention it stays), and the runtime's
    model rebuilt on meta and a user's model with real weights must give the same graph.
    """
    from torch.export import Dim

    inputs = tuple(torch.empty(_batch_at_least_two(x.shape), dtype=x.dtype, device="meta")
                   for x in example_inputs)
    dynamic = tuple((Dim.AUTO, *(Dim.STATIC,) * (x.dim() - 1)) if x.dim() else {} for x in inputs)
    exported = torch.export.export(_meta_copy(model), inputs, dynamic_shapes=dynamic, strict=False)
    module = exported.module()
    _inline_scoped_regions(module)
    for node in list(module.graph.nodes):
        guard = node.op == "call_module" and node.target == "_guards_fn"
        # checks that a .to() gave the traced dtype and device: false where the runtime computes in
        # 16 bits or on another device
        metadata_check = (node.op == "call_function"
                          and node.target is torch.ops.aten._assert_tensor_metadata.default)
        unused_weight = node.op == "get_attr" and not node.users  # export lifts every weight
        if guard or metadata_check or unused_weight:
            module.graph.erase_node(node)
    _return_plain_values(module.graph)
    _devices_from_inputs(module.graph)
    _bind_state(module, model)
    module.recompile()
    return module


def _inline_scoped_regions(module: torch.fx.GraphModule) -> None:
    """Inline the grad-mode and autocast regions export wraps as higher-order ops, nested ones first.

    A ``torch.no_grad()`` block (Llama's rotary embedding is one) or ``torch.autocast(enabled=False)``
    block (rotary embeddings of other transformers versions) may become ``wrap_with_set_grad_enabled(False, submod, *operands)`` or
    ``wrap_with_autocast(device, dtype, False, cache, submod, *operands)``: a call of a nested
    GraphModule that the graph's costing, splitting and cleaning (the metadata asserts, the baked
    meta device) would not see into. The body's nodes are copied into the graph instead. The
    runtime trains with gradients on and a disabled autocast region computes in the model's own
    dtype either way, so only a region that turns gradients off needs more: its outputs are
    detached, as the region's are (they carry no autograd history). A region that turns autocast
    on is refused in one line: its body computes in another dtype than the graph would say.
    """
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target not in _scoped_regions():
            continue
        body_at, operands, detach = _region_call(node)
        body = getattr(module, body_at.target)
        _inline_scoped_regions(body)
        with module.graph.inserting_before(node):
            values = dict(zip(body.graph.find_nodes(op="placeholder"), operands))
            result = module.graph.graph_copy(body.graph, values)
            if detach:
                result = torch.utils._pytree.tree_map_only(
                    torch.fx.Node, lambda value: module.graph.call_function(torch.ops.aten.detach.default,
                                                                            (value,)), result)
        _replace_region_outputs(node, result)
        module.graph.erase_node(node)
        if not body_at.users:
            module.graph.erase_node(body_at)
            delattr(module, body_at.target)
    module.recompile()


def _scoped_regions() -> tuple[object, ...]:
    return (torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast)


def _region_call(node: torch.fx.Node) -> tuple[torch.fx.Node, tuple[object, ...], bool]:
    """The body's get_attr node, the operands, and whether the outputs must be detached."""
    if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
        enabled, body_at, *operands = node.args
        return body_at, tuple(operands), not enabled
    device_type, dtype, enabled, _, body_at, *operands = node.args
    if enabled:
        raise TraceError(f"the exported graph computes a region under torch.autocast({device_type!r}, "
                         f"dtype={dtype}); tessera plans one precision for the whole model: remove the "
                         f"autocast block from forward() and give the precision to plan() instead")
    return body_at, tuple(operands), False


def _replace_region_outputs(node: torch.fx.Node, result: object) -> None:
    """Point the users of a region call (``getitem(call, i)`` for a tuple body) at the copied values."""
    if not isinstance(result, (tuple, list)):
        node.replace_all_uses_with(result)
        return
    for user in [user for user in node.users if user.target is operator.getitem]:
        user.replace_all_uses_with(result[user.args[1]])
        user.graph.erase_node(user)
    if node.users:  # the tuple itself is used: rebuild it from the copied values
        with node.graph.inserting_before(node):
            node.replace_all_uses_with(node.graph.call_function(tuple, (list(result),)))


def _batch_at_least_two(shape: torch.Size) -> tuple[int, ...]:
    """``shape`` with its batch dimension (the first) raised to 2 if it is 1."""
    return (max(shape[0], 2), *shape[1:]) if len(shape) else ()


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are empty meta tensors (nothing is allocated)."""
    memo: dict[int, object] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        is_parameter = isinstance(tensor, nn.Parameter)
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if is_parameter else meta
    return copy.deepcopy(model, memo)


def _bind_state(module: nn.Module, model: nn.Module) -> None:
    """Point the exported module's parameters and buffers back at ``model``'s (real or meta) tensors."""
    modules = dict(module.named_modules())
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        path, _, attr = name.rpartition(".")
        owner = modules.get(path)
        for table in (owner._parameters, owner._buffers) if owner is not None else ():
            if attr in table:
                table[attr] = tensor


def _return_plain_values(graph: torch.fx.Graph) -> None:
    """Take positional inputs and return the output's tensors, without export's pytree wrapping."""
    graph._codegen = torch.fx.graph.CodeGen()
    output = next(node for node in graph.nodes if node.op == "output")
    leaves = torch.utils._pytree.tree_leaves(output.args[0])
    output.args = (leaves[0] if len(leaves) == 1 else tuple(leaves),)


def _devices_from_inputs(graph: torch.fx.Graph) -> None:
    """Replace the devices export bakes into factory calls (``arange(..., device='meta')`` when the
    model is on meta) by the device of the first input, read in the graph, as fx tracing gives it."""
    baked = [node for node in graph.nodes
             if any(isinstance(value, torch.device) for value in (*node.args, *node.kwargs.values()))]
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    if not baked or not inputs:
        return
    with graph.inserting_after(inputs[-1]):
        device = graph.call_function(getattr, (inputs[0], "device"))
    for node in baked:
        node.args = tuple(device if isinstance(value, torch.device) else value for value in node.args)
        node.kwargs = {key: device if isinstance(value, torch.device) else value
                       for key, value in node.kwargs.items()}


@contextlib.contextmanager
def _captured_torch_output() -> Iterator[io.StringIO]:
    """Everything printed (sys.stdout, sys.stderr) or logged by torch's loggers, into one buffer.

    torch's loggers write through handlers bound to the real stderr when torch was imported, so
    redirecting sys.stderr alone would not catch them: their streams are swapped for the buffer.
    """
    buffer = io.StringIO()
    terminals = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    handlers = {id(handler): handler for name, logger in logging.root.manager.loggerDict.items()
                if name.startswith("torch") and isinstance(logger, logging.Logger)
                for handler in logger.handlers
                if type(handler) is logging.StreamHandler and handler.stream in terminals}
    streams = [(handler, handler.setStream(buffer)) for handler in handlers.values()]
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            yield buffer
    finally:
        for handler, stream in streams:
            handler.setStream(stream)


def _both_failed_message(model: nn.Module, fx_error: BaseException,
                         export_error: BaseException) -> str:
    name = type(model).__name__
    return (f"cannot trace {name}: torch.fx symbolic tracing failed ({describe_error(fx_error)}) "
            f"and the torch.export fallback failed ({describe_error(export_error)}). "
            f"Python control flow that depends on tensor values cannot be captured. Fix: mark the "
            f"submodule that contains it as a leaf, e.g. trace(model, inputs, "
            f"leaf_modules=[MyBlock]) or leaf_modules=['encoder.block3'] (CLI: --leaf MyBlock), "
            f"or rewrite the branch with torch.where / torch.cond.")
