"""A split backward (ZB-H1's I and W) that computes each half once.

I computes the gradients of the stage's received inputs and keeps, per group of weights, the gradients
that flow into the ops joining those weights to the inputs' path; W computes the weights' gradients from
them without backpropagating through the activation path a second time (I is torch.distributed.pipelining's
``stage_backward_input``, private, as torch's zero-bubble schedules use it; W runs its groups as torch's
``stage_backward_weight`` does, with the changes :func:`backward_weight` gives).
A weight that never joins the path from the received inputs (the first stage's inputs carry no gradient; a
weight used only on values that carry none) would be missed, so a stage whose weights the groups do not all
cover runs W as a backward from its outputs into the weights (the graph I kept): torch's schedules do the
same for their first stage. That is decided once per stage, on its first micro-batch (a stage's graph is the
same every step). Between I and W the groups hold their captured gradients, beside the saved activations W
still reads. A checkpointed region is recomputed in I and again in each W group reading it (a backward
recomputes it once): the planner does not recompute under a split backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def backward_weight(weights: Sequence[torch.Tensor], groups: ParamGroups,
                    made: Callable[[torch.Tensor], None] | None = None) -> None:
    """W: the weights' gradients, accumulated into their ``.grad``, from what I kept: one backward per group,
    from its kept gradients to its own weights only (the activation path is not crossed again), as torch's
    ``stage_backward_weight`` runs them, with two differences. Every backward but the last keeps the graph:
    two groups may reach one node (a weight used twice in the stage), which a backward freeing what it crossed
    would leave the next without. And each weight's gradient accumulator is looked up once, not once per
    group (each lookup makes a view: with tens of groups that was milliseconds a W). ``made`` is called with each
    weight once its gradient is in ``.grad`` (autograd's post-accumulate-grad hooks do not run here)."""
    weight_of = {_get_grad_fn_or_grad_acc(weight): weight for weight in weights}
    last = len(groups) - 1
    for index, group in enumerate(groups):
        kept, ops = group.pop("grads", None) or (), group.pop("intermediates")
        roots = [(GradientEdge(op, slot), grad) for saved, op in zip(kept, ops) if saved is not None
                 for slot, grad in enumerate(saved) if grad is not None]
        if not roots:
            continue
        handles = []
        if len(ops) > 1:  # each op gets its own kept gradients, not what another kept op downstream adds
            handles = [op.register_prehook(lambda _, saved=saved: saved)
                       for saved, op in zip(kept, ops) if saved is not None]
        try:
            nodes = list(group["params"])
            grads = torch.autograd.grad([edge for edge, _ in roots], [GradientEdge(node, 0) for node in nodes],
                                        grad_outputs=[grad for _, grad in roots], retain_graph=index < last)
        finally:
            for handle in handles:
                handle.remove()
        for node, grad in zip(nodes, grads):
            weight = weight_of[node]
            if weight.grad is None:
                weight.grad = grad
            else:
                weight.grad += grad
            if made is not None:
                made(weight)
