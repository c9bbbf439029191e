"""A split backward (ZB-H1's I and W) that computes each half once.

I computes the gradients of the stage's received inputs and keeps, per group of weights, the gradients
that flow into the ops joining those weights to the inputs' path (torch.distributed.pipelining's
``stage_backward_input``, private, as torch's zero-bubble schedules use it). W computes every weight's
gradient from them in one backward (:func:`backward_weight`) without backpropagating through the
activation path a second time. A weight that never joins the path from the received inputs (the first
stage's inputs carry no gradient; a weight used only on values that carry none) would be missed, so a
stage whose weights the groups do not all cover runs W as a backward from its outputs into the weights
(the graph I kept): torch's schedules do the same for their first stage. That is decided once per stage,
on its first micro-batch (a stage's graph is the same every step). Between I and W the groups hold their
captured gradients, beside the saved activations W still reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
    stage_backward_input,
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
    """W: the weights' gradients, accumulated into their ``.grad``, from what I kept, in one backward.

    torch's ``stage_backward_weight`` runs one backward per group, each freeing the graph it crossed: two
    groups reaching one node (a weight used twice, as a shared layer is) fail on the second, and a
    checkpointed region is recomputed once per group reading it. One backward from every group's kept
    gradients crosses each node once. Each op I kept gradients at is given exactly those (a pre-hook), so
    what reaches it from another kept op downstream is not counted twice."""
    weight_of = {_get_grad_fn_or_grad_acc(weight): weight for weight in weights}
    roots: list[GradientEdge] = []
    root_grads: list[torch.Tensor] = []
    nodes: dict[Any, torch.Tensor] = {}  # a weight's gradient accumulator -> the weight
    handles = []
    try:
        for group in groups:
            for kept, op in zip(group.pop("grads", None) or (), group.pop("intermediates")):
                if kept is None:  # nothing reached that op in I
                    continue
                handles.append(op.register_prehook(lambda _, kept=kept: kept))
                for index, grad in enumerate(kept):
                    if grad is not None:
                        roots.append(GradientEdge(op, index))
                        root_grads.append(grad)
            nodes.update((node, weight_of[node]) for node in group["params"])
        if not roots:
            return
        grads = torch.autograd.grad(roots, [GradientEdge(node, 0) for node in nodes], grad_outputs=root_grads)
    finally:
        for handle in handles:
            handle.remove()
    for weight, grad in zip(nodes.values(), grads):
        if weight.grad is None:
            weight.grad = grad
        else:
            weight.grad += grad
