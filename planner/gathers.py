"""ZeRO-3's gather groups: which consecutive layers' weights one all-gather fetches, chosen for each stage of a plan.

The search costs ZeRO-3 layer by layer (planner/search/terms.py: each module call gathers its weights before its
forward and its backward and reduce-scatters its gradients after it; the largest layer gathered whole). Every
collective also costs its link's fixed time, and on gloo a rank's own core time for its messages: fewer, larger
gathers are faster, at the memory of the largest group (a 3.4M-parameter GPT on 2 CPU ranks: about 207 ms a step
gathering each of its 28 layers apart, 147 ms in the 12 groups its plan's memory allowed). Once the search chose a
ZeRO-3 plan, each of its stages groups consecutive layers up to the size the memory the plan leaves on its ranks
allows (and no larger than :data:`LATENCY_SHARE` makes worth it): the memory
rows grow by :func:`~planner.search.terms.gathered_layer_copies` copies of what the largest group adds over the
largest layer, and the stage's times lose the fixed cost of each collective saved. The runtime gathers a group at
its first layer's forward and frees it after its last (runtime/layer_gathers.py), so a group never spans the runs
the runtime cuts the stage into: a checkpoint region, a run of swapped nodes, or the plain runs between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cost_models.graph.ir import LayerGraph, NodeKind
from planner.plan import OffloadSpec
from planner.search.evaluate import PartSummary

_NOT_COMPUTED = (NodeKind.PARAM, NodeKind.INPUT, NodeKind.OUTPUT)

LATENCY_SHARE = 0.05
"""A group need not grow past the size whose gather's fixed time is this share of the time its bytes take: larger
ones save under a twentieth of their gathering time while the memory rows grow with them (GPT-2 medium on 8 V100s,
where the memory left allowed 12 groups of about 110 MB, saving 34 ms a step of 1.26 s, makes groups of up to 72 MB
at this share)."""


def group_cap_bytes(largest_layer_bytes: float, room_bytes: float, gather_ms: float,
                    gather_ms_per_byte: float) -> float:
    """The most weight bytes a group may gather: within the memory room (``room_bytes``, in bytes of the largest
    group) and no larger than :data:`LATENCY_SHARE` makes worth it for a gather of ``gather_ms`` fixed and
    ``gather_ms_per_byte``; the largest layer whatever they say (it is gathered whole anyway)."""
    worth = gather_ms / (LATENCY_SHARE * gather_ms_per_byte) if gather_ms_per_byte > 0 else float("inf")
    return max(float(largest_layer_bytes), min(room_bytes, worth))


@dataclass(frozen=True)
class LayerCall:
    """One module call of a stage that reads parameters its layers gather."""

    layer: str  # the module called (a layer called twice is one layer)
    params: tuple[str, ...]  # the gathered parameters it reads
    weight_bytes: int
    segment: int  # the run of the stage the runtime executes it in (see the module docstring)
    recomputed: bool  # in a checkpoint region: gathered again in its backward


@dataclass(frozen=True)
class Gathers:
    """A stage's gather groups and the collectives they make per micro-batch."""

    groups: tuple[tuple[str, ...], ...]  # parameter names, each group one all-gather
    largest_bytes: int  # the weight bytes of the largest group
    forward: int  # all-gathers in a forward
    recompute: int  # all-gathers of a backward's recomputed regions (at most)

    @property
    def backward(self) -> int:
        """All-gathers (and as many gradient reduce-scatters) in a backward, its recomputation apart."""
        return len(self.groups)


def layer_calls(graph: LayerGraph, nodes: Sequence[str], gathered: frozenset[str],
                weight_bytes: Mapping[str, int], offload: OffloadSpec) -> tuple[LayerCall, ...]:
    """The module calls among ``nodes`` (a stage's, in order) that read parameters of ``gathered``, with the run of
    the stage each falls in (:func:`segments`) and whether it is recomputed."""
    segment = segments(graph, nodes, offload)
    recomputed = offload.recomputed_nodes
    calls = []
    for name in nodes:
        node = graph.node(name)
        params = tuple(p for p in dict.fromkeys(node.param_names) if p in gathered)
        if node.kind is NodeKind.MODULE and params:
            calls.append(LayerCall(node.target, params, sum(weight_bytes[p] for p in params), segment[name],
                                   name in recomputed))
    return tuple(calls)


def segments(graph: LayerGraph, nodes: Sequence[str], offload: OffloadSpec) -> dict[str, int]:
    """Each computed node's run in the stage as the runtime cuts it (runtime/regions.py): each checkpoint region,
    each run of consecutive swapped nodes, and the plain runs between them."""
    region = {name: index for index, nodes_of in enumerate(offload.recompute) for name in nodes_of}
    swapped = set(offload.swap)
    runs: dict[str, int] = {}
    run, last = -1, None
    for name in nodes:
        if graph.node(name).kind in _NOT_COMPUTED:
            continue
        label = ("recompute", region[name]) if name in region else ("swap",) if name in swapped else ("plain",)
        if label != last:
            run, last = run + 1, label
        runs[name] = run
    return runs


def group_layers(calls: Sequence[LayerCall], cap_bytes: float) -> Gathers:
    """Consecutive layers of one run grouped while a group's weights stay within ``cap_bytes`` (a layer larger
    than that alone), and the collectives the runtime's hooks then make: a forward opens a group at the first
    layer of it that runs after a layer of another group, and closes it after its last layer."""
    groups: list[list[LayerCall]] = []
    position: dict[str, tuple[int, int]] = {}  # layer -> (its group, its place in it)
    placed: dict[str, tuple[int, int]] = {}  # parameter -> the place of the first layer reading it
    for call in calls:
        seen = [placed[p] for p in call.params if p in placed]
        if call.layer not in position and seen:  # (a layer reading another's parameter: gathered with it)
            position[call.layer] = seen[0]
        if call.layer in position:  # (and a layer called again)
            continue
        current = groups[-1] if groups else None
        if (current is None or current[-1].segment != call.segment
                or sum(c.weight_bytes for c in current) + call.weight_bytes > cap_bytes):
            groups.append([])
        groups[-1].append(call)
        position[call.layer] = (len(groups) - 1, len(groups[-1]) - 1)
        placed.update({p: position[call.layer] for p in call.params})
    last = {group: len(members) - 1 for group, members in enumerate(groups)}

    def openings(run: Sequence[LayerCall]) -> int:
        count, open_group = 0, None
        for call in run:
            group, index = position[call.layer]
            if group != open_group:
                count, open_group = count + 1, group
            if index == last[group]:
                open_group = None
        return count

    recomputed: dict[int, list[LayerCall]] = {}
    for call in calls:
        if call.recomputed:
            recomputed.setdefault(call.segment, []).append(call)
    return Gathers(tuple(tuple(p for call in members for p in call.params) for members in groups),
                   max((sum(call.weight_bytes for call in members) for members in groups), default=0),
                   openings(calls), sum(openings(run) for run in recomputed.values()))


def regrouped(part: PartSummary, calls: Sequence[LayerCall], gathers: Gathers, *, gather_ms: float,
              reduce_ms: float, copies_held: tuple[float, float], largest_layer_bytes: int) -> PartSummary:
    """``part`` (as the search costed it: a gather per layer, :func:`group_layers` at no cap) with the
    collectives of ``gathers``: each all-gather saved ``gather_ms`` less, each reduce-scatter ``reduce_ms``, and
    ``copies_held[0]`` copies of the largest group's weights held in place of the ``copies_held[1]`` copies of the
    largest layer's (``largest_layer_bytes``, the model's) that the search counts."""
    per_layer = group_layers(calls, 0)
    fewer_forward = per_layer.forward - gathers.forward
    fewer_backward = per_layer.backward - gathers.backward
    fewer_recompute = per_layer.recompute - gathers.recompute
    return dataclasses.replace(
        part, fwd_ms=part.fwd_ms - fewer_forward * gather_ms,
        bwd_ms=part.bwd_ms - fewer_backward * (gather_ms + reduce_ms) - fewer_recompute * gather_ms,
        static_bytes=part.static_bytes + round(copies_held[0] * gathers.largest_bytes
                                               - copies_held[1] * largest_layer_bytes))
