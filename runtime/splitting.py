"""``split_module`` whose submodules always return a tuple, on every torch the project supports.

The runtime calls each part's submodule and unpacks its outputs by position, so a part with one
output must still return a 1-tuple. torch 2.13 says so with ``split_module(..., tuple_return=True)``;
earlier releases (e.g. 2.11, the CUDA build GPU machines run) lack the argument, and there the
split graph is rewritten to the same form: each single-output submodule returns ``(value,)`` and
its callers in the parent graph read element 0.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module


def split_tupled(module: torch.fx.GraphModule, root: nn.Module, part_of: Callable[[torch.fx.Node], int],
                 **options: Any) -> torch.fx.GraphModule:
    """``split_module(module, root, part_of, **options)`` with every submodule returning a tuple."""
    if "tuple_return" in inspect.signature(split_module).parameters:
        return split_module(module, root, part_of, tuple_return=True, **options)
    return tuple_outputs(split_module(module, root, part_of, **options))


def tuple_outputs(split: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``split`` (changed in place) with each submodule that returns one value returning a 1-tuple."""
    for node in list(split.graph.nodes):
        if node.op != "call_module":
            continue
        submodule = split.get_submodule(str(node.target))
        output = next(n for n in submodule.graph.nodes if n.op == "output")
        if isinstance(output.args[0], tuple):
            continue
        output.args = ((output.args[0],),)
        submodule.recompile()
        with split.graph.inserting_after(node):
            first = split.graph.call_function(operator.getitem, (node, 0))
        node.replace_all_uses_with(first, delete_user_cb=lambda user, first=first: user is not first)
    split.recompile()
    return split
