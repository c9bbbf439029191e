"""Which parts of a module can run on tiles: an fx trace, each node's role, and its tile grid.

The analysis walks the traced graph in order, gives every node a role (window layer, batch-norm,
pointwise, element-wise merge, channel concat) and the tile grid its output is owned by, and
raises SpatialError naming the first layer that cannot be tiled exactly.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from cost_models.errors import SpatialError
from runtime.spatial.tiling import TileGrid
from runtime.spatial.window import WINDOW_MODULES, WindowSpec, window_spec

POINTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh,
                     nn.Hardswish, nn.Hardsigmoid, nn.PReLU, nn.Identity)
POINTWISE_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    torch.relu, F.relu, F.relu6, F.leaky_relu, F.elu, F.gelu, F.silu, F.mish, torch.sigmoid, torch.tanh,
    F.hardswish, F.hardsigmoid)
MERGE_FUNCTIONS: tuple[Callable[..., Any], ...] = (operator.add, operator.sub, operator.mul, torch.add,
                                                   torch.sub, torch.mul)
POINTWISE_METHODS = frozenset({"relu", "relu_", "sigmoid", "tanh", "contiguous"})
MERGE_METHODS = frozenset({"add", "add_", "sub", "mul"})
CHANNEL_DIMS = (1, -3)

_WHY_NOT: dict[type, str] = {
    nn.AdaptiveAvgPool2d: "it pools over the whole image",
    nn.AdaptiveMaxPool2d: "it pools over the whole image",
    nn.Linear: "it reads every pixel",
    nn.Flatten: "it mixes the image's rows and columns",
    nn.Dropout: "each tile would draw its own random mask",
    nn.Dropout2d: "each tile would draw its own random mask",
    nn.Upsample: "it resamples the whole image",
    nn.ZeroPad2d: "it moves pixels across the tile borders",
    nn.ConvTranspose2d: "transposed convolutions are not supported on tiles yet",
}


class Role(str, Enum):
    """What a node does to tiles."""

    INPUT = "input"
    WINDOW = "window"  # Conv2d / MaxPool2d / AvgPool2d: reads a halo
    BATCH_NORM = "batch_norm"  # needs image-wide statistics
    POINTWISE = "pointwise"  # pixel by pixel
    MERGE = "merge"  # element-wise add/sub/mul of tiles of the same grid
    CONCAT = "concat"  # torch.cat along channels
    OUTPUT = "output"


@dataclass(frozen=True)
class SpatialNode:
    """One traced node: its role, the tensors it reads, and the grid its output is tiled by."""

    name: str
    layer: str  # module path or function name, for messages
    role: Role
    inputs: tuple[str, ...]
    grid: TileGrid | None
    spec: WindowSpec | None = None


@dataclass(frozen=True)
class SpatialGraph:
    """The analysed graph of a module: nodes in execution order."""

    module: fx.GraphModule
    nodes: tuple[SpatialNode, ...]

    @functools.cached_property
    def _by_name(self) -> dict[str, SpatialNode]:
        return {node.name: node for node in self.nodes}

    def __getitem__(self, name: str) -> SpatialNode:
        return self._by_name[name]

    @property
    def inputs(self) -> tuple[SpatialNode, ...]:
        return tuple(node for node in self.nodes if node.role is Role.INPUT)

    @property
    def output(self) -> SpatialNode:
        return self.nodes[-1]


def trace_spatial(module: nn.Module) -> fx.GraphModule:
    """Symbolically trace ``module`` with torch.nn layers as leaves; SpatialError if it cannot be traced.

    A lone torch.nn layer is traced inside a one-layer Sequential (named after its class), so it
    stays a leaf and errors name it. A GraphModule (a pipeline stage cut from the planner's trace)
    is its own trace: its node names stay the plan's, which fused groups and offload regions name.
    """
    if isinstance(module, fx.GraphModule):
        return module
    if fx.Tracer().is_leaf_module(module, ""):
        module = nn.Sequential(OrderedDict([(type(module).__name__, module)]))
    try:
        return fx.symbolic_trace(module)
    except Exception as error:
        raise SpatialError(f"{type(module).__name__} cannot be traced with torch.fx to find its tileable "
                           f"layers ({type(error).__name__}: {error}); spatialize a module without "
                           f"data-dependent control flow") from error


def _tensor_args(node: fx.Node) -> tuple[str, ...]:
    found: list[str] = []
    fx.node.map_arg((node.args, node.kwargs), lambda arg: found.append(arg.name))
    return tuple(found)


def _layer_name(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _untileable(node: fx.Node, kind: str, why: str) -> SpatialError:
    return SpatialError(f"layer {_layer_name(node)!r} ({kind}) cannot run on tiles: {why}; join the tiles "
                        f"(gather them to the first non-spatial stage) before it")


def _module_role(node: fx.Node, module: nn.Module) -> tuple[Role, WindowSpec | None]:
    if isinstance(module, WINDOW_MODULES):
        return Role.WINDOW, window_spec(module, str(node.target))
    if type(module) is nn.BatchNorm2d:
        return Role.BATCH_NORM, None
    if isinstance(module, POINTWISE_MODULES):
        return Role.POINTWISE, None
    why = _WHY_NOT.get(type(module), "tessera does not know how it moves pixels (supported: Conv2d, MaxPool2d, "
                                     "AvgPool2d, BatchNorm2d, element-wise activations, add/mul, channel cat)")
    raise _untileable(node, type(module).__name__, why)


def _function_role(node: fx.Node) -> Role:
    if node.target in POINTWISE_FUNCTIONS:
        return Role.POINTWISE
    if node.target in MERGE_FUNCTIONS:
        return Role.MERGE
    if node.target in (torch.cat, torch.concat):
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        if dim in CHANNEL_DIMS:
            return Role.CONCAT
        raise _untileable(node, "torch.cat", f"it concatenates along dim={dim}, not the channel dim")
    raise _untileable(node, "function", "it is not a known element-wise or channel operation")


def _method_role(node: fx.Node) -> Role:
    if node.target in POINTWISE_METHODS:
        return Role.POINTWISE
    if node.target in MERGE_METHODS:
        return Role.MERGE
    raise _untileable(node, f"Tensor.{node.target}", "it may reshape or reduce the tile")


def _role(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[Role, WindowSpec | None]:
    if node.op == "placeholder":
        return Role.INPUT, None
    if node.op == "output":
        return Role.OUTPUT, None
    if node.op == "call_module":
        return _module_role(node, modules[str(node.target)])
    if node.op == "call_function":
        return _function_role(node), None
    if node.op == "call_method":
        return _method_role(node), None
    raise _untileable(node, node.op, "it reads a tensor attribute that cannot be split into tiles")


def _output_grid(node: fx.Node, role: Role, spec: WindowSpec | None, grids: dict[str, TileGrid | None],
                 grid: TileGrid, input_grids: Mapping[str, TileGrid]) -> TileGrid | None:
    if role is Role.INPUT:
        return input_grids.get(node.name, grid)
    inputs = [grids[name] for name in _tensor_args(node)]
    if role is Role.OUTPUT:
        return inputs[0] if inputs else None
    if role is Role.WINDOW:
        assert spec is not None
        spec.check_size(inputs[0].height, inputs[0].width, _layer_name(node))  # type: ignore[union-attr]
        return inputs[0].after(spec.rows, spec.cols, layer=_layer_name(node))  # type: ignore[union-attr]
    if any(other != inputs[0] for other in inputs[1:]):
        shapes = sorted({(g.row_edges, g.col_edges) for g in inputs if g is not None})
        raise SpatialError(f"layer {_layer_name(node)!r} combines tensors tiled differently ({shapes}); "
                           f"its operands must come from layers with the same strides and paddings")
    return inputs[0]


def analyse(traced: fx.GraphModule, grid: TileGrid,
            input_grids: Mapping[str, TileGrid] | None = None) -> SpatialGraph:
    """Give every node its role and tile grid; SpatialError at the first misfit.

    Every input (placeholder) is tiled by ``grid`` unless ``input_grids`` gives it its own (a later
    spatial stage receives each value tiled over that value's own height and width).
    """
    modules = dict(traced.named_modules())
    grids: dict[str, TileGrid | None] = {}
    nodes = []
    for node in traced.graph.nodes:
        role, spec = _role(node, modules)
        grids[node.name] = _output_grid(node, role, spec, grids, grid, input_grids or {})
        nodes.append(SpatialNode(node.name, _layer_name(node), role, _tensor_args(node), grids[node.name], spec))
    return SpatialGraph(traced, tuple(nodes))
