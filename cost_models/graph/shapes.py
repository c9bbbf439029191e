"""Shape propagation: run a captured GraphModule on fake tensors and keep every node's value."""

from __future__ import annotations

import operator
from copy import deepcopy
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensorMode,
                                           unset_fake_temporarily)
from torch.utils import _pytree as pytree

from cost_models.graph.ir import TensorMeta

VALUE_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
"""What fake tensors raise when an op's result depends on values (a leaf then runs on zeros)."""


def propagate(module: torch.fx.GraphModule, inputs: Sequence[torch.Tensor],
              device: torch.device | str = "cpu") -> dict[str, Any]:
    """Every node's value (fake tensors, Python values) from one fake run of ``module``.

    Only the shapes and dtypes of ``inputs`` are used (meta tensors are fine). Parameters and
    buffers may be real or on the meta device: the run reads fake copies of them on ``device``,
    so nothing is allocated and no buffer changes. Autograd is on, so a value's requires_grad
    says whether a gradient flows back to it. A leaf module whose forward branches on values
    runs once on real zero-valued CPU tensors.

    Example::

        values = propagate(traced, (torch.empty(8, 3, 224, 224, device="meta"),))
        values["layer1_0_conv1"].shape
    """
    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode, torch.enable_grad():
        state = fake_state(module, device)
        fakes = [torch.empty(x.shape, dtype=x.dtype, device=device) for x in inputs]
        return _FakeInterpreter(module, state, fake_mode, device).values(fakes)


def node_outputs(module: torch.fx.GraphModule, values: Mapping[str, Any]
                 ) -> dict[str, tuple[TensorMeta, ...]]:
    """The tensors each node produces (the output node only hands on its inputs' values)."""
    return {node.name: () if node.op == "output" else tensor_metas(values[node.name])
            for node in module.graph.nodes}


SCALAR_WIRE_DTYPES: dict[type, torch.dtype] = {bool: torch.bool, int: torch.int64, float: torch.float64}
"""The tensor a Python scalar (or, for int, each element of a tuple of ints such as torch.Size) crosses a
stage boundary as (runtime/values.py sends them so; the cost model counts their bytes from it)."""


def crosses_boundary(value: Any) -> bool:
    """Whether a node's value can cross a stage boundary as the runtime sends values (runtime/values.py): a
    tensor, a Python scalar, a tuple of ints, None, a device or a dtype; not a tuple of tensors (a split's),
    a list, a dict or any other object, which only the stage that makes it may read.

    >>> crosses_boundary(torch.empty(2)), crosses_boundary((2, 3)), crosses_boundary((torch.empty(2),) * 2)
    (True, True, False)
    """
    return (isinstance(value, (torch.Tensor, bool, int, float, torch.device, torch.dtype)) or value is None
            or (isinstance(value, tuple) and all(type(v) is int for v in value)))


def tensor_metas(value: Any) -> tuple[TensorMeta, ...]:
    """Shape, dtype, logical size and requires_grad of every tensor inside ``value``; a Python scalar or a
    tuple of ints (a value that can cross a stage boundary) as the tensor it travels as."""
    python = type(value) in SCALAR_WIRE_DTYPES or (isinstance(value, tuple) and bool(value)
                                                   and all(type(v) is int for v in value))
    if python:
        wire = (torch.empty((), dtype=SCALAR_WIRE_DTYPES[type(value)]) if type(value) in SCALAR_WIRE_DTYPES
                else torch.empty(len(value), dtype=torch.int64))
        return (TensorMeta(tuple(wire.shape), dtype_name(wire.dtype), wire.numel() * wire.element_size(),
                           python=True),)
    return tuple(TensorMeta(tuple(t.shape), dtype_name(t.dtype), t.numel() * t.element_size(),
                            t.requires_grad) for t in tensor_leaves(value))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a (nested) value, in pytree order."""
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def named_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer name, tied aliases included."""
    return [*module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False)]


def fake_state(module: torch.nn.Module, device: torch.device | str = "cpu") -> dict[int, torch.Tensor]:
    """A fake tensor on ``device`` for every parameter and buffer, keyed by the real one's id().

    Call it inside a FakeTensorMode. Tied aliases share one fake.
    """
    fakes: dict[int, torch.Tensor] = {}
    for _, tensor in named_state(module):
        if id(tensor) not in fakes:
            fakes[id(tensor)] = fake_like(tensor, device)
    return fakes


def fake_like(tensor: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor with ``tensor``'s layout, dtype and requires_grad on ``device``.

    Call it inside a FakeTensorMode to get a fake one (nothing allocated).
    """
    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return fake.requires_grad_(tensor.requires_grad)


def concrete_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A real CPU copy of ``module``; weights on the meta device become zeros."""
    copy = deepcopy(module)
    if any(t.device.type == "meta" for t in [*copy.parameters(), *copy.buffers()]):
        copy = copy.to_empty(device="cpu")
        with torch.no_grad():
            for tensor in [*copy.parameters(), *copy.buffers()]:
                tensor.zero_()
    return copy.cpu()


def zeros_like_value(value: Any) -> Any:
    """A real zero-valued CPU tensor standing in for a fake one (requires_grad kept, not a leaf)."""
    if not isinstance(value, torch.Tensor):
        return value
    real = torch.zeros(value.shape, dtype=value.dtype)
    return real.requires_grad_(True).clone() if value.requires_grad else real


class _FakeInterpreter(torch.fx.Interpreter):
    """torch.fx.Interpreter whose parameters, buffers and attributes are fakes; records values."""

    def __init__(self, module: torch.fx.GraphModule, state: dict[int, torch.Tensor],
                 fake_mode: FakeTensorMode, device: torch.device | str) -> None:
        super().__init__(module, garbage_collect_values=False)
        self.state = state
        self.fake_mode = fake_mode
        self.device = torch.device(device)
        self.recorded: dict[str, Any] = {}

    def values(self, inputs: Iterable[torch.Tensor]) -> dict[str, Any]:
        self.run(*inputs)
        return self.recorded

    def run_node(self, node: torch.fx.Node) -> Any:
        self.recorded[node.name] = value = super().run_node(node)
        return value

    def get_attr(self, target: str, args: Any, kwargs: Any) -> Any:  # type: ignore[override]
        value = operator.attrgetter(target)(self.module)
        if isinstance(value, torch.Tensor) and id(value) in self.state:
            return self.state[id(value)]
        if isinstance(value, torch.Tensor):
            return self.fake_mode.from_tensor(value)
        return value

    def call_module(self, target: str, args: Any, kwargs: Any) -> Any:  # type: ignore[override]
        submodule = self.module.get_submodule(target)
        local = {name: self.state[id(tensor)] for name, tensor in named_state(submodule)}
        try:
            return torch.func.functional_call(submodule, local, tuple(args), dict(kwargs))
        except VALUE_DEPENDENT:
            return self._call_concrete(submodule, args, kwargs)

    def _call_concrete(self, submodule: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        with unset_fake_temporarily():
            output = concrete_copy(submodule)(*pytree.tree_map(zeros_like_value, tuple(args)),
                                              **pytree.tree_map(zeros_like_value, dict(kwargs)))
        return pytree.tree_map(self._to_fake, output)

    def _to_fake(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        with unset_fake_temporarily():
            moved = value.detach().to(self.device)
        return self.fake_mode.from_tensor(moved).requires_grad_(value.requires_grad)
