"""What a stage holds beside its model state while it computes: a node's working set, and a part's node by node.

A node's working set is its output's gradient with what its backward allocates: its inputs' gradients and
its parameters' new ones, and any workspace the kernel takes (measured where the profile measured it,
``NodeCost.measured_bwd_bytes``; else estimated as one more output's worth, and the parameters' gradients).

The search counts a part's saved activations whole beside its largest working set and its gradients (a
bound: the unit structure cannot say which node is where). Node by node, the part holds less: while node n's
backward runs, what only the nodes after it saved is gone (autograd freed it as their backwards ran; in the
forward what they make is not yet made); the gradients of values that a later node also reads wait beside it
(a skip connection's). In the step's first backward the gradients come as the activations go, node by node:
a network whose weights sit late and whose activations sit early (a ResNet: wide late layers, large early
images) holds most of both at once, mid-backward. :func:`part_working` is each moment's excess over the part's
saved activations at its worst node; the plan counts them (planner/assemble.py: its forwards and a split
backward's I in the static bytes, its later backwards in the accumulate event, its first backward as an event
of the simulator) where the part keeps every activation (no recompute, no swap, no tiles).

A value the part receives is held by the runtime until the micro-batch's backward ends, whichever of the
part's nodes saves it; the ledger says which node first saves a storage, not where it was made, so the
backwards of the nodes before that saver count a received value as freed too soon. None do where the saver
is the part's first node (a transformer block's or a ResNet block's input, saved by its first layer) or
nothing saves it (a U-Net's skips, read by concatenations).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cost_models.estimation import CostTable
from cost_models.graph.ir import LayerGraph, NodeKind
from cost_models.loss import loss_memory_bytes
from cost_models.memory import Optimizer, Precision, model_state_bytes


@dataclass(frozen=True)
class NodeWorking:
    """One computing node's working set (bytes) in the step's first backward (``working``, its forward's is
    no larger), in a backward adding into existing gradients (``accumulating``), and in a split backward's W
    (``weight_grad``: its parameters' new gradients and the kernel's workspace, not its inputs' gradients,
    which the I made)."""

    working: int
    accumulating: int
    weight_grad: int


@dataclass(frozen=True)
class PartWorking:
    """What a part holds above its saved activations at its worst node (bytes): in a forward or a backward
    making no weight gradient (``transient_bytes``: a split backward's I; the loss's working bytes among
    them), in the step's first backward (``first_backward_bytes``: with the gradients it made so far, not
    yet in the model state) and in a backward adding into its gradients (``accumulating_bytes``)."""

    transient_bytes: int
    first_backward_bytes: int
    accumulating_bytes: int


def node_working(graph: LayerGraph, table: CostTable, name: str, precision: Precision,
                 optimizer: Optimizer) -> NodeWorking:
    """Node ``name``'s working sets (module docstring); its parameters' gradients each time it is used."""
    cost = table[name]
    grads = _gradient_bytes(graph, graph.node(name).param_names, precision, optimizer)
    if cost.measured_bwd_bytes is None:  # the input's gradient as large as the output; W's workspace too
        working = 2 * cost.output_bytes
        return NodeWorking(working, max(working, cost.output_bytes + grads), max(cost.output_bytes, grads))
    accumulating = cost.output_bytes + cost.measured_bwd_bytes
    inputs_grads = sum(table[source].output_bytes for source in graph.node(name).inputs
                       if graph.node(source).kind is not NodeKind.PARAM)
    return NodeWorking(max(cost.output_bytes, accumulating - grads), accumulating,
                       max(grads, cost.measured_bwd_bytes - inputs_grads))


def _gradient_bytes(graph: LayerGraph, params: Iterable[str], precision: Precision, optimizer: Optimizer) -> int:
    """The gradients of parameters ``params`` (each once; buffers have none)."""
    return sum(model_state_bytes(graph.parameter(p).numel, precision, optimizer).grad_bytes
               for p in dict.fromkeys(params) if not graph.parameter(p).is_buffer)


def loss_bytes(graph: LayerGraph, table: CostTable, names: Sequence[str], precision: Precision) -> tuple[int, int]:
    """What the loss holds per micro-batch where ``names`` hold the graph's output (it is not part of the
    graph): what it keeps until that micro-batch's backward, and its working bytes in that backward
    (cost_models.loss.loss_memory_bytes, in the loss's dtype); (0, 0) elsewhere."""
    numel = sum(table[source].output_bytes for name in names if graph.node(name).kind is NodeKind.OUTPUT
                for source in graph.node(name).inputs) // precision.itemsize
    return loss_memory_bytes(numel, precision.loss_itemsize)


def part_working(graph: LayerGraph, table: CostTable, names: Sequence[str], precision: Precision,
                 optimizer: Optimizer) -> PartWorking:
    """The working excess of the part of nodes ``names`` (in graph order), node by node (module docstring).

    At computing node n's backward: its working set with its parameters' new gradients, plus the gradients
    waiting for an earlier value that a node after n reads, less what autograd freed in the backwards after
    n (the storages those nodes were the first to save, and what the loss kept); in the step's first
    backward, plus the gradients those backwards made. In its forward: its output, less what the nodes
    after n will make and save. The loss's working bytes come first, in the forward's end and every
    backward's start. ``transient_bytes`` also covers a backward making no weight gradient (a split
    backward's I), which no event of the simulator counts apart."""
    position = {name: index for index, name in enumerate(names)}
    loss_kept, loss_working = loss_bytes(graph, table, names, precision)
    computing = [name for name in names if graph.node(name).kind not in (NodeKind.PARAM, NodeKind.OUTPUT)]
    waiting = _waiting_grad_bytes(graph, table, names, position)
    transient = first = accumulating = loss_working
    freed_after = made_after = loss_kept  # gone before any node's backward: the loss's ran first
    grads_after = 0
    seen: set[str] = set()  # parameters whose gradient a later node's backward made
    for name in reversed(computing):
        work = node_working(graph, table, name, precision, optimizer)
        cost = table[name]
        transient = max(transient, cost.output_bytes - made_after, work.working + waiting[position[name]] - freed_after)
        accumulating = max(accumulating, work.accumulating + waiting[position[name]] - freed_after)
        first = max(first, work.accumulating + waiting[position[name]] + grads_after - freed_after)
        freed_after += cost.freed_activation_bytes
        made_after += cost.saved_activation_bytes
        fresh = [p for p in graph.node(name).param_names if p not in seen]
        seen.update(fresh)
        grads_after += _gradient_bytes(graph, fresh, precision, optimizer)
    return PartWorking(transient, max(transient, first), max(transient, accumulating))


def _waiting_grad_bytes(graph: LayerGraph, table: CostTable, names: Sequence[str],
                        position: dict[str, int]) -> list[int]:
    """Per position in ``names``: the gradients of values made before it (here or in an earlier part) that a
    node after it, in the part, reads: their gradient from that later reader waits until the value's own
    backward."""
    change = [0] * (len(names) + 1)
    for name in names:
        node = graph.node(name)
        if node.kind is NodeKind.PARAM:
            continue
        for value in dict.fromkeys(node.inputs):
            made = graph.node(value)
            if made.kind is NodeKind.PARAM or not (made.outputs and all(meta.requires_grad for meta in made.outputs)):
                continue  # no gradient comes back to it
            start = position.get(value, -1) + 1  # a value from an earlier part: from the part's first node
            readers = [position[user] for user in graph.users[value] if user in position]
            if position[name] == max(readers) and start < position[name]:  # once per value, to its last reader
                change[start] += table[value].output_bytes
                change[position[name]] -= table[value].output_bytes
    waiting, running = [], 0
    for delta in change[:-1]:
        running += delta
        waiting.append(running)
    return waiting
