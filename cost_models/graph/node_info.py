"""Static facts about one fx node: readable target, op type, window geometry, spatial splittability."""

from __future__ import annotations

import operator
from typing import Any, Callable, Mapping

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from cost_models.graph.ir import Geometry, TensorMeta

# Module types whose output at each pixel depends only on the same pixel (any tile computes it
# exactly), and those whose window needs a halo; batch norm is exact when statistics are synced.
_POINTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.GELU, nn.SiLU,
                      nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Identity,
                      nn.Dropout, nn.Dropout2d, nn.BatchNorm2d, nn.SyncBatchNorm)
_POINTWISE_FUNCTIONS = {operator.add, operator.mul, operator.sub, operator.truediv, torch.add,
                        torch.mul, torch.sub, torch.relu, torch.sigmoid, torch.tanh, F.relu,
                        F.gelu, F.silu, F.dropout, F.batch_norm}
_POINTWISE_METHODS = {"relu", "relu_", "sigmoid", "tanh", "add", "add_", "mul", "mul_",
                      "contiguous", "clone"}
_POINTWISE_ATEN = {"relu", "relu_", "add", "add_", "mul", "mul_", "sub", "gelu", "silu",
                   "sigmoid", "tanh", "dropout", "batch_norm", "clone", "hardtanh", "hardtanh_"}


def target_name(node: torch.fx.Node) -> str:
    """A stable, readable name for what the node calls."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    if module in ("_operator", "builtins"):
        module = "operator" if module == "_operator" else module
    return f"{module}.{name}" if module else name


def op_type(node: torch.fx.Node, root: nn.Module) -> str:
    """Short operator name: the module class for call_module, else the function/method name."""
    if node.op == "call_module":
        return type(root.get_submodule(node.target)).__name__
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return target._opname
        return getattr(target, "__name__", str(target))
    if node.op == "call_method":
        return str(node.target)
    return node.op


Shapes = Mapping[str, tuple[int, ...]]
"""First-output shape of every node, by node name."""


def geometry(node: torch.fx.Node, root: nn.Module, shapes: Shapes) -> Geometry | None:
    """Kernel/stride/padding/dilation of a convolution or pooling node, else None."""
    if node.op == "call_module":
        return _module_geometry(root.get_submodule(node.target))
    if node.op == "call_function":
        handler = _FUNCTION_GEOMETRY.get(_function_key(node.target))
        return handler(node, shapes) if handler else None
    return None


def spatially_splittable(node: torch.fx.Node, root: nn.Module, window: Geometry | None,
                         outputs: tuple[TensorMeta, ...]) -> bool:
    """True when tiles of the image can compute this node exactly (halo exchange for windows)."""
    if len(outputs) != 1 or len(outputs[0].shape) != 4:
        return False
    if window is not None:  # a ceil-mode pool, where its input size lets it (cost_models.halo.windows_of)
        return window.padding_mode == "zeros"
    if node.op == "call_module":
        return isinstance(root.get_submodule(node.target), _POINTWISE_MODULES)
    if node.op == "call_method":
        return node.target in _POINTWISE_METHODS
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            return node.target._opname in _POINTWISE_ATEN or _is_channel_cat(node)
        return node.target in _POINTWISE_FUNCTIONS or _is_channel_cat(node)
    return False


def _is_channel_cat(node: torch.fx.Node) -> bool:
    name = getattr(node.target, "_opname", getattr(node.target, "__name__", ""))
    if name not in ("cat", "concat"):
        return False
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return dim in (1, -3)


def _pair(value: Any, rank: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * rank
    values = tuple(int(v) for v in value)
    return values * rank if len(values) == 1 else values


def _module_geometry(module: nn.Module) -> Geometry | None:
    if isinstance(module, nn.modules.conv._ConvNd):
        rank = len(module.kernel_size)
        op = "conv_transpose" if module.transposed else "conv"
        padding = module.padding if not isinstance(module.padding, str) else _same_padding(module)
        return Geometry(op, tuple(module.kernel_size), tuple(module.stride), _pair(padding, rank),
                        tuple(module.dilation), module.padding_mode)
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        rank = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}[type(module)]
        stride = module.stride if module.stride is not None else module.kernel_size
        return Geometry("max_pool", _pair(module.kernel_size, rank), _pair(stride, rank),
                        _pair(module.padding, rank), _pair(module.dilation, rank),
                        ceil_mode=bool(module.ceil_mode))
    if isinstance(module, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        rank = {nn.AvgPool1d: 1, nn.AvgPool2d: 2, nn.AvgPool3d: 3}[type(module)]
        stride = module.stride if module.stride is not None else module.kernel_size
        return Geometry("avg_pool", _pair(module.kernel_size, rank), _pair(stride, rank),
                        _pair(module.padding, rank), (1,) * rank, ceil_mode=bool(module.ceil_mode))
    return None


def _same_padding(module: nn.modules.conv._ConvNd) -> tuple[int, ...]:
    if module.padding == "valid":
        return (0,) * len(module.kernel_size)
    return tuple(d * (k - 1) // 2 for k, d in zip(module.kernel_size, module.dilation))


def _function_key(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}"
    return getattr(target, "__name__", "")


def _arg(node: torch.fx.Node, index: int, name: str, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def _conv_geometry(node: torch.fx.Node, shapes: Shapes) -> Geometry:
    kernel = tuple(shapes[_arg(node, 1, "weight", None).name][2:])
    rank = len(kernel)
    transposed = _function_key(node.target) == "aten.convolution" and bool(_arg(node, 6, "transposed", False))
    return Geometry("conv_transpose" if transposed else "conv", kernel,
                    _pair(_arg(node, 3, "stride", 1), rank), _pair(_arg(node, 4, "padding", 0), rank),
                    _pair(_arg(node, 5, "dilation", 1), rank))


def _pool_geometry(op: str) -> Callable[[torch.fx.Node, Shapes], Geometry]:
    def extract(node: torch.fx.Node, shapes: Shapes) -> Geometry:
        kernel = _pair(_arg(node, 1, "kernel_size", 1), 2)
        stride = _arg(node, 2, "stride", None) or kernel
        dilation = _pair(_arg(node, 4, "dilation", 1), 2) if op == "max_pool" else (1, 1)
        ceil_index = 5 if op == "max_pool" else 4
        return Geometry(op, kernel, _pair(stride, 2), _pair(_arg(node, 3, "padding", 0), 2),
                        dilation, ceil_mode=bool(_arg(node, ceil_index, "ceil_mode", False)))
    return extract


_FUNCTION_GEOMETRY: dict[str, Callable[[torch.fx.Node, Shapes], Geometry]] = {
    "conv1d": _conv_geometry, "conv2d": _conv_geometry, "conv3d": _conv_geometry,
    "aten.conv1d": _conv_geometry, "aten.conv2d": _conv_geometry, "aten.conv3d": _conv_geometry,
    "aten.convolution": _conv_geometry,
    "max_pool2d": _pool_geometry("max_pool"), "aten.max_pool2d": _pool_geometry("max_pool"),
    "aten.max_pool2d_with_indices": _pool_geometry("max_pool"),
    "avg_pool2d": _pool_geometry("avg_pool"), "aten.avg_pool2d": _pool_geometry("avg_pool"),
}
