"""Replay the fake measurement of a node identical to one already measured (repeated blocks).

A ResNet-1001 repeats one bottleneck 333 times and a GPT one layer dozens of times; measuring
each copy on fake tensors again gives the same FLOPs, outputs and saved tensors relative to its
inputs. A node is identical when it calls the same standard torch.nn module configuration (or
the same function/method) on inputs with the same shapes, strides, dtypes, requires_grad and
aliasing. Its recording is replayed: outputs re-created (as views where they alias an input)
and every saved tensor re-attributed through the storage ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch
import torch.fx
from torch.utils import _pytree as pytree

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout)


@dataclass(frozen=True)
class OutputRecipe:
    """How to re-create one output tensor: a view of an input or of a fresh storage group."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
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


@dataclass(frozen=True)
class Recording:
    fwd_flops: int
    bwd_flops: int
    spec: Any  # pytree spec of the output
    leaves: tuple[OutputRecipe | Any, ...]  # recipes for tensors, the value itself otherwise
    saved: tuple[SavedRef, ...]


def node_key(node: torch.fx.Node, root: torch.nn.Module, args: Any, kwargs: Any,
             param_keys: set[int]) -> Hashable | None:
    """What makes two nodes' measurements identical, or None when it cannot be told safely."""
    callee = _callee(node, root)
    if callee is None:
        return None
    leaves, spec = pytree.tree_flatten((args, kwargs))
    groups: dict[int, int] = {}
    described: list[Hashable] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key = leaf.untyped_storage()._cdata
            described.append((tuple(leaf.shape), tuple(leaf.stride()), leaf.storage_offset(),
                              leaf.dtype, leaf.requires_grad, key in param_keys,
                              groups.setdefault(key, len(groups))))
        elif isinstance(leaf, _PLAIN) or (isinstance(leaf, tuple) and all(isinstance(v, int) for v in leaf)):
            described.append(("value", leaf))
        else:
            return None
    return callee, str(spec), tuple(described)


def _callee(node: torch.fx.Node, root: torch.nn.Module) -> Hashable | None:
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
                                    leaf.dtype, leaf.requires_grad, source,
                                    leaf.untyped_storage().nbytes()))
    refs = []
    for tensor in saved:
        key = resolve(tensor)
        kind, index = (("param", -1) if key in param_keys else ("input", input_keys[key])
                       if key in input_keys else ("output", output_keys[key])
                       if key in output_keys else ("internal", -1))
        refs.append(SavedRef(kind, index, tensor.dtype, tensor.untyped_storage().nbytes()))
    return Recording(fwd_flops, bwd_flops, spec, tuple(recipes), tuple(refs))


def rebuild_output(recording: Recording, inputs: Sequence[torch.Tensor]) -> Any:
    """New output tensors (fake, under the active mode) laid out as the recording says."""
    bases: dict[int, torch.Tensor] = {}
    leaves = []
    for recipe in recording.leaves:
        if not isinstance(recipe, OutputRecipe):
            leaves.append(recipe)
            continue
        kind, index = recipe.source
        if kind == "input":
            base = inputs[index].detach()
        else:
            itemsize = torch.empty((), dtype=recipe.dtype).element_size()
            base = bases.setdefault(index, torch.empty(recipe.storage_nbytes // itemsize, dtype=recipe.dtype))
        view = base.as_strided(recipe.shape, recipe.stride, recipe.offset)
        leaves.append(view.detach().requires_grad_(recipe.requires_grad))
    return pytree.tree_unflatten(leaves, recording.spec)
