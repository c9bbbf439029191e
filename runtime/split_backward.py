"""A split backward (ZB-H1's I and W) that computes each half once.

I computes the gradients of the stage's received inputs and keeps, per group of weights, the gradients
that flow into the ops joining those weights to the inputs' path; W computes the weights' gradients from
them without backpropagating through the activation path a second time (torch.distributed.pipelining's
``stage_backward_input`` and ``stage_backward_weight``, private, as torch's zero-bubble schedules use them).
A weight that never joins the path from the received inputs (the first stage's inputs carry no gradient; a
weight used only on values that carry none) would be missed, so a stage whose weights the groups do not all
cover runs W as a backward from its outputs into the weights (the graph I kept): torch's schedules do the
same for their first stage. That is decided once per stage,
on its first micro-batch (a stage's graph is the same every step). Between I and W the groups hold their
captured gradients, beside the saved activations W still reads. A checkpointed region is recomputed in I
and again in each W group reading it (a backward recomputes it once): the planner does not recompute under
a split backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
    stage_backward_input,
    stage_backward_weight,
)

ParamGroups = list[dict[str, Any]]


def covers_every_weight(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                        weights: Sequence[torch.Tensor]) -> bool:
    """Whether I's weight groups (from ``inputs``) hold every weight the backward from ``roots`` reaches."""
    reverse = construct_reverse_graph([node for node in map(_get_grad_fn_or_grad_acc, roots) if node is not None])
    input_nodes = [_get_grad_fn_or_grad_acc(x) for x in inputs if x.requires_grad]
    reached = [node for node in map(_get_grad_fn_or_grad_acc, weights) if node in reverse]
    if not input_nodes:
        return not reached
    covered = set().union(*(group["params"] for group in get_param_groups(input_nodes, reached, reverse)))
    return set(reached) <= covered


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> ParamGroups:
    """I: the inputs' gradients (into their ``.grad``); returns what W needs. torch detaches the roots it is
    given in place afterwards, which neither a view nor a tensor some op saved allows: it is given copies
    (one elementwise op per root)."""
    owned = [root.clone() for root in roots]
    _, groups = stage_backward_input(owned, list(grads), list(inputs), iter(weights))
    return groups


def backward_weight(weights: Sequence[torch.Tensor], groups: ParamGroups) -> None:
    """W: the weights' gradients, accumulated into their ``.grad``, from what I kept: one backward per group,
    each from its kept gradients to its own weights only (the activation path is not crossed again). Every
    backward but the last keeps the graph: two groups may reach one node (a weight used twice in the
    stage), which a backward freeing what it crossed would leave the next without."""
    for index, group in enumerate(groups):
        stage_backward_weight(iter(weights), [group], retain_graph=index < len(groups) - 1)
