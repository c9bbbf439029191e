"""Replay the fake measurement of a node identical to one already measured (repeated blocks).

A ResNet-1001 repeats one bottleneck 333 times and a GPT one layer dozens of times; measuring
each copy on fake tensors again gives the same FLOPs, outputs and saved tensors relative to its
inputs. A node is identical when it calls the same standard torch.nn module configuration (or
the same function/method) on inputs with the same shapes, strides, dtypes, requires_grad and
aliasing. Its recording is replayed: outputs re-created (as views where they alias an input)
and every saved tensor re-attributed through the storage ledger.

A replay runs once per repeated node (1594 times for the 62-block GPT-50B), so it does no
more than it must: its outputs are ReplayedTensors (a layout on a meta storage, no FakeTensor
and no dispatched op) until a node that really runs reads them, and what every replay of a
recording shares (the outputs' TensorMetas) is computed once when it is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from cost_models.fake_factory import fake_view, fresh_storage
from cost_models.graph.ir import TensorMeta
from cost_models.graph.shapes import tensor_metas

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout)
_PLAIN_TYPES = frozenset(_PLAIN)


@dataclass(frozen=True)
class OutputRecipe:
    """How to re-create one output tensor: a view of an input or of a fresh storage group."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    source: tuple[str, int]  # ("input", flat input index) or ("new", storage group)
    storage_nbytes: int


@dataclass(frozen=True)
class SavedRef:
    """A tensor autograd saved: an input's storage, an output's storage, or an internal one."""

    kind: str  # "input", "output", "internal" or "param"
    index: int
    dtype: torch.dtype
    nbytes: int


class ReplayedTensor:
    """An output of a replayed node: its layout and storage, built as a FakeTensor only when read.

    Most replayed outputs are read by replayed nodes only, which need just the layout and the
    storage (for their key, their own outputs' storages and the storage ledger). Building each
    as a FakeTensor would cost about 25 us (FakeTensor's constructor); this costs about 1 us.
    The storage is a real meta storage, so storage keys (``untyped_storage()._cdata``) are
    those the FakeTensor built from it will have.
    """

    __slots__ = ("device", "dtype", "offset", "requires_grad", "shape", "storage", "strides")

    def __init__(self, shape: tuple[int, ...], strides: tuple[int, ...], offset: int,
                 dtype: torch.dtype, device: torch.device, requires_grad: bool,
                 storage: torch.UntypedStorage) -> None:
        self.shape = shape
        self.strides = strides
        self.offset = offset
        self.dtype = dtype
        self.device = device
        self.requires_grad = requires_grad
        self.storage = storage

    def untyped_storage(self) -> torch.UntypedStorage:
        """The storage, as a tensor's method names it (the storage ledger keys by it)."""
        return self.storage

    def build(self, mode: FakeTensorMode) -> FakeTensor:
        """The FakeTensor of ``mode`` this stands for: a leaf viewing the storage."""
        return fake_view(mode, self.storage, self.shape, self.strides, self.offset, self.dtype,
                         self.device, self.requires_grad)


def build_replayed(value: Any, mode: FakeTensorMode) -> Any:
    """``value`` with every ReplayedTensor in it built as a FakeTensor (for a node that runs)."""
    if not any(isinstance(leaf, ReplayedTensor) for leaf in pytree.tree_leaves(value)):
        return value
    return pytree.tree_map(lambda leaf: leaf.build(mode) if isinstance(leaf, ReplayedTensor) else leaf,
                           value)


@dataclass(frozen=True)
class Recording:
    fwd_flops: int
    bwd_flops: int
    spec: Any  # pytree spec of the output
    leaves: tuple[OutputRecipe | Any, ...]  # recipes for tensors, the value itself otherwise
    saved: tuple[SavedRef, ...]
    metas: tuple[TensorMeta, ...]  # the outputs' TensorMetas, the same on every replay


def flatten_values(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Hashable]:
    """The leaves of ``(args, kwargs)`` in pytree order, and a hashable description of its nesting.

    Most nodes take tensors and scalars directly; their leaves are the arguments themselves,
    found without pytree's flatten (about 20 us a node, for 1600 nodes of a GPT-50B). Nested
    values (a tuple of tensors, a list of sizes) go through pytree. Two nodes get the same
    description only when their values nest the same way.
    """
    values = [*args, *kwargs.values()]
    if all(isinstance(value, (torch.Tensor, ReplayedTensor)) or type(value) in _PLAIN_TYPES
           for value in values):
        return values, ("flat", len(args), tuple(kwargs))
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return leaves, ("nested", str(spec))


def node_key(node: torch.fx.Node, root: torch.nn.Module, leaves: Sequence[Any], nesting: Hashable,
             param_keys: set[int]) -> Hashable | None:
    """What makes two nodes' measurements identical, or None when it cannot be told safely.

    ``leaves`` and ``nesting`` are what flatten_values() gives for the node's values.
    Only FakeTensor and ReplayedTensor inputs are described (a replay views their meta
    storages), each the same way.
    """
    callee = callee_key(node, root)
    if callee is None:
        return None
    groups: dict[int, int] = {}
    described: list[Hashable] = []
    for leaf in leaves:
        if isinstance(leaf, ReplayedTensor):
            key = leaf.storage._cdata
            described.append((leaf.shape, leaf.strides, leaf.offset, leaf.dtype, leaf.requires_grad,
                              key in param_keys, groups.setdefault(key, len(groups))))
        elif isinstance(leaf, FakeTensor):
            key = leaf.untyped_storage()._cdata
            described.append((tuple(leaf.shape), leaf.stride(), leaf.storage_offset(),
                              leaf.dtype, leaf.requires_grad, key in param_keys,
                              groups.setdefault(key, len(groups))))
        elif isinstance(leaf, torch.Tensor):
            return None
        elif isinstance(leaf, _PLAIN) or (isinstance(leaf, tuple) and all(isinstance(v, int) for v in leaf)):
            described.append(("value", leaf))
        else:
            return None
    return callee, nesting, tuple(described)


def callee_key(node: torch.fx.Node, root: torch.nn.Module) -> Hashable | None:
    """What a node calls, as far as its measurements go: a torch.nn module's type, settings, mode and
    parameter and buffer shapes, or the function or method; None for a user's module."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        if not type(module).__module__.startswith("torch.nn."):
            return None  # a user's module may hold state its repr does not show
        state = tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                      for name, t in [*module.named_parameters(), *module.named_buffers()])
        return "module", type(module), module.extra_repr(), module.training, state
    if node.op == "call_function":
        return "function", node.target
    if node.op == "call_method":
        return "method", node.target
    return None


def record(inputs: Sequence[torch.Tensor], output: Any, saved: Sequence[torch.Tensor],
           resolve: Any, param_keys: set[int], fwd_flops: int, bwd_flops: int) -> Recording:
    """Describe ``output`` and ``saved`` relative to ``inputs`` (keys resolved through aliases)."""
    input_keys = {resolve(t): index for index, t in reversed(list(enumerate(inputs)))}
    leaves, spec = pytree.tree_flatten(output)
    groups: dict[int, int] = {}
    output_keys: dict[int, int] = {}
    recipes: list[OutputRecipe | Any] = []
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            recipes.append(leaf)
            continue
        key = resolve(leaf)
        output_keys.setdefault(key, index)
        source = (("input", input_keys[key]) if key in input_keys
                  else ("new", groups.setdefault(key, len(groups))))
        recipes.append(OutputRecipe(tuple(leaf.shape), tuple(leaf.stride()), leaf.storage_offset(),
                                    leaf.dtype, leaf.device, leaf.requires_grad, source,
                                    leaf.untyped_storage().nbytes()))
    refs = []
    for tensor in saved:
        key = resolve(tensor)
        kind, index = (("param", -1) if key in param_keys else ("input", input_keys[key])
                       if key in input_keys else ("output", output_keys[key])
                       if key in output_keys else ("internal", -1))
        refs.append(SavedRef(kind, index, tensor.dtype, tensor.untyped_storage().nbytes()))
    return Recording(fwd_flops, bwd_flops, spec, tuple(recipes), tuple(refs), tensor_metas(output))


def rebuild_output(recording: Recording, inputs: Sequence[torch.Tensor | ReplayedTensor]
                   ) -> tuple[Any, list[Any]]:
    """New outputs (ReplayedTensors) laid out as the recording says: (output, its leaves).

    A "new" storage group gets a fresh storage of the size a ``torch.empty`` of the group's
    first dtype would have; an output aliasing an input views that input's storage.
    """
    storages: dict[int, torch.UntypedStorage] = {}
    leaves = []
    for recipe in recording.leaves:
        if not isinstance(recipe, OutputRecipe):
            leaves.append(recipe)
            continue
        kind, index = recipe.source
        device = recipe.device
        if kind == "input":
            storage, device = inputs[index].untyped_storage(), inputs[index].device
        elif index in storages:
            storage = storages[index]
        else:
            itemsize = recipe.dtype.itemsize
            storage = storages[index] = fresh_storage(recipe.storage_nbytes // itemsize * itemsize)
        leaves.append(ReplayedTensor(recipe.shape, recipe.stride, recipe.offset, recipe.dtype, device,
                                     recipe.requires_grad, storage))
    if recording.spec.is_leaf():
        return leaves[0], leaves
    return pytree.tree_unflatten(leaves, recording.spec), leaves
