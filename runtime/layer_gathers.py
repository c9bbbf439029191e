"""ZeRO-3 layer by layer: a stage's sharded parameters gathered around its layers' forwards and backwards.

A stage whose parameters are sharded (ZeRO-3, runtime/stage_optimizer.py) holds only its chunk of each
between uses. Gathering the whole stage for every forward and backward would hold every parameter at once,
beside the whole gradients: no less than ZeRO-1 at the peak. Here the stage's layers (the modules its forward
calls, found inside the runs, checkpoint regions and swapped runs that runtime/offload.py cut it into) gather
their parameters in groups, one all-gather per group, as ZeRO-3 and FSDP gather per wrapped block:

* the plan's groups (``OffloadSpec.gathers``: consecutive layers' parameters, chosen by the planner within the
  memory the plan leaves, planner/gathers.py), or one group per layer where it names none;
* before a group's first layer's forward its parameters are all-gathered; after its last layer's forward (or
  when a layer of another group starts) they are freed again;
* before its layers' backward (a hook on their outputs' gradients, the first to arrive) they are gathered once
  more; when every one of them has its gradient (post-accumulate-grad hooks) the parameters are freed and that
  micro-batch's gradients reduce-scattered at once, each rank adding its chunk to its shard's sum
  (``StageOptimizer.reduce_now``): no whole gradient outlives its group's backward;
* a checkpointed region recomputes its layers' forwards inside the backward: their hooks gather and free
  again. Gathers are counted per parameter, so a group whose backward holds its parameters keeps them through
  its own recompute;
* where the plan says so (``OffloadSpec.prefetch``: on NCCL), each gather starts the one that comes next
  (FSDP's forward and backward prefetch: ``StageOptimizer.gather_ahead``), so that it runs while the group
  computes: in a forward the next group, in a backward the one before, where the order is certain (not into a
  checkpoint region, whose recomputation may come first). The plan does not count what this hides
  (planner/search/terms.py costs each gather on the critical path); it counts its buffers.

Parameters in no group (those the stage's graph also reads through ``get_attr``, as a GPT's tied embedding and
head, and those the plan leaves out) keep the whole-pass gather of ``StageOptimizer.in_use``. Every replica of
the stage runs the same graph, so the collectives come in the same order on each. Why not FSDP2's
``fully_shard`` per block: runtime/sharding.py's docstring (its DTensor parameters replace the ones the
executor and the optimizer tiers hold).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from cost_models.errors import RuntimeSetupError
from runtime.recompute import Checkpointed

if TYPE_CHECKING:
    from planner.plan import OffloadSpec
    from runtime.stage_optimizer import StageOptimizer

_TOP = -1  # the segment of layers the stage's own graph calls (not inside a run or region cut out of it)


def layer_calls(module: nn.Module) -> list[tuple[nn.Module, int, bool]]:
    """The layers ``module`` calls, each once, in the order of their first call, with the segment each runs in:
    the position of the run, checkpoint region or swapped run (runtime/regions.py cuts a stage into those
    submodules) that calls it, or ``_TOP`` for a layer the stage's graph calls itself; and whether that segment is
    a checkpoint region. A layer is a module whose forward is not itself a graph of calls: an ``nn.Linear``, or a
    fused block of the spatial runtime."""
    seen: set[int] = set()
    calls: list[tuple[nn.Module, int, bool]] = []
    for layer, segment, recomputed in _walk(module, None, False):
        if id(layer) not in seen:
            seen.add(id(layer))
            calls.append((layer, segment, recomputed))
    return calls


def _walk(module: nn.Module, segment: int | None, recomputed: bool) -> Iterator[tuple[nn.Module, int, bool]]:
    if not isinstance(module, torch.fx.GraphModule):
        yield module, _TOP if segment is None else segment, recomputed
        return
    for position, node in enumerate(node for node in module.graph.nodes if node.op == "call_module"):
        called = module.get_submodule(node.target)
        inner = _graph_of(called)
        if inner is None:
            yield called, _TOP if segment is None else segment, recomputed
        else:
            yield from _walk(inner, position if segment is None else segment,
                             recomputed or isinstance(called, Checkpointed))


def _graph_of(module: nn.Module) -> torch.fx.GraphModule | None:
    """The graph a called module runs: itself (a cut run), the one graph it wraps (a checkpointed or swapped
    region), or None (a layer)."""
    if isinstance(module, torch.fx.GraphModule):
        return module
    graphs = [child for child in module.children() if isinstance(child, torch.fx.GraphModule)]
    return graphs[0] if len(graphs) == 1 and next(module.parameters(recurse=False), None) is None else None


class LayerGathers:
    """The hooks that gather, free and reduce one ZeRO-3 stage's parameters group by group."""

    def __init__(self, module: nn.Module, state: StageOptimizer, read: Iterable[torch.Tensor],
                 names: Mapping[int, str], gathers: Sequence[Sequence[str]], *, ahead: bool, stage: int) -> None:
        """``names``: each parameter's canonical name by ``id``; ``gathers``: the plan's groups of names (empty:
        one group per layer); ``ahead``: each gather starts the next one (the plan's ``prefetch``)."""
        self.state = state
        self.ahead = ahead
        read_ids = {id(tensor) for tensor in read}  # fed to the graph as inputs: used outside any one layer
        index_of = {id(param): index for index, param in enumerate(state.params)
                    if index in state.param_shards and id(param) not in read_ids}
        found = layer_calls(module)
        recomputed = {segment for _layer, segment, again in found if again}
        calls = [(layer, segment, tuple(sorted({index_of[id(p)] for p in layer.parameters() if id(p) in index_of})))
                 for layer, segment, _again in found]
        calls = [call for call in calls if call[2]]
        if gathers:
            self.groups, group_of = _planned_groups(gathers, index_of, names, calls, stage)
        else:
            self.groups, group_of = _one_per_layer(calls)
        self._group_of_index = group_of
        self._last: dict[int, int] = {}  # group -> its last layer (position among the layers)
        self._segment: dict[int, int] = {}  # group -> the segment of its first layer
        self._recomputed = recomputed  # segments that are checkpoint regions
        calls = [call for call in calls if any(index in group_of for index in call[2])]  # (others: whole-pass)
        for position, (layer, segment, indices) in enumerate(calls):
            group = next(group_of[index] for index in indices if index in group_of)
            self._last[group] = position
            self._segment.setdefault(group, segment)
            layer.register_forward_pre_hook(functools.partial(self._before_forward, group))
            layer.register_forward_hook(functools.partial(self._after_forward, group, position),
                                        always_call=True)  # (also where a recomputation stops early inside it)
        self.covered = frozenset(group_of)
        for index in self.covered:
            if state.params[index].requires_grad:
                state.params[index].register_post_accumulate_grad_hook(functools.partial(self._grad_made, index))
        self._open: int | None = None  # the group a forward holds
        self._held = [0] * len(self.groups)  # backward gathers not yet released, per group
        self._waiting: list[set[int]] = [set() for _ in self.groups]  # per group: gradients its backward awaits
        self._backward = False  # in a backward pass (whose forwards are recomputations)

    def _before_forward(self, group: int, _layer: nn.Module, _args: Any) -> None:
        if self._open == group:
            return
        if self._open is not None:  # (a layer of another group runs: the open one is done)
            self.state.release(self.groups[self._open])
        self.state.gather(self.groups[group])
        self._open = group
        following = group + 1  # next, unless a recomputation ends with this group
        if self.ahead and following < len(self.groups) and (not self._backward
                                                             or self._segment[following] == self._segment[group]):
            self.state.gather_ahead(self.groups[following])

    def _after_forward(self, group: int, position: int, _layer: nn.Module, _args: Any, output: Any) -> None:
        if self._open == group and self._last[group] == position:
            self.state.release(self.groups[group])
            self._open = None
        outputs = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(outputs, functools.partial(self._before_backward, group),
                                                          mode="any")

    def _before_backward(self, group: int, _grad: Any) -> None:
        if self._held[group] and self._waiting[group]:  # (another of its layers' backward gathered it)
            return
        self._backward = True
        self.state.gather(self.groups[group])
        self._held[group] += 1
        self._waiting[group] = {index for index in self.groups[group] if self.state.params[index].requires_grad}
        before = group - 1  # the next backward, unless that group's recomputation comes first
        if self.ahead and before >= 0 and (self._segment[before] == self._segment[group]
                                           or self._segment[before] not in self._recomputed):
            self.state.gather_ahead(self.groups[before])

    def _grad_made(self, index: int, _param: torch.Tensor) -> None:
        group = self._group_of_index[index]
        waiting = self._waiting[group]
        if index in waiting:
            waiting.discard(index)
            if not waiting:
                self._backward_done(group)

    def _backward_done(self, group: int) -> None:
        """Group ``group``'s parameters freed, then its gradients of this micro-batch reduce-scattered (the
        parameters and the sum's table are never held at once)."""
        if self._held[group]:
            self._held[group] -= 1
            self.state.release(self.groups[group])
        self.state.reduce_now([index for index in self.groups[group] if self.state.params[index].grad is not None])

    def end_pass(self) -> None:
        """After a forward or backward: release what a forward left open (a recomputation that stopped early) and
        what a group's backward still holds where it made no gradient for some parameter (those it made are
        reduced with the whole-pass ones at ALLREDUCE)."""
        self.state.drop_ahead()
        self._backward = False
        if self._open is not None:
            self.state.release(self.groups[self._open])
            self._open = None
        for group, held in enumerate(self._held):
            for _ in range(held):
                self.state.release(self.groups[group])
            self._held[group] = 0
            self._waiting[group] = set()


def _one_per_layer(calls: Sequence[tuple[nn.Module, int, tuple[int, ...]]]
                   ) -> tuple[list[tuple[int, ...]], dict[int, int]]:
    """A group per layer, in their order (what a plan naming no groups gathers); layers sharing a parameter share
    one group."""
    groups: list[set[int]] = []
    group_of: dict[int, int] = {}
    for _layer, _segment, indices in calls:
        joined = sorted({group_of[index] for index in indices if index in group_of})
        target = joined[0] if joined else len(groups)
        if not joined:
            groups.append(set())
        for other in joined[1:]:  # (merged into the first)
            groups[target] |= groups[other]
            groups[other] = set()
        groups[target].update(indices)
        group_of.update(dict.fromkeys(groups[target], target))
    kept = [tuple(sorted(group)) for group in groups if group]
    return kept, {index: number for number, group in enumerate(kept) for index in group}


def _planned_groups(gathers: Sequence[Sequence[str]], index_of: Mapping[int, int], names: Mapping[int, str],
                    calls: Sequence[tuple[nn.Module, int, tuple[int, ...]]], stage: int
                    ) -> tuple[list[tuple[int, ...]], dict[int, int]]:
    """The plan's groups as parameter indices; refused where they name parameters the stage does not gather by
    layer, split a layer's parameters, or span the runs and regions the stage was cut into."""
    by_name = {names[param_id]: index for param_id, index in index_of.items() if param_id in names}
    strangers = sorted(name for group in gathers for name in group if name not in by_name)
    if strangers:
        raise RuntimeSetupError(f"stage {stage}'s plan gathers parameters {strangers[:4]} by layer, but the stage "
                                f"does not shard them or reads them outside its layers; re-plan it with "
                                f"`tessera plan`")
    groups = [tuple(sorted(by_name[name] for name in group)) for group in gathers]
    group_of = {index: number for number, group in enumerate(groups) for index in group}
    segments: dict[int, set[int]] = {}
    for layer, segment, indices in calls:
        mine = {group_of[index] for index in indices if index in group_of}
        if len(mine) > 1:
            raise RuntimeSetupError(f"stage {stage}'s plan gathers the parameters of one layer "
                                    f"({type(layer).__name__}) in groups {sorted(mine)}; a layer's parameters are "
                                    f"gathered together: re-plan it with `tessera plan`")
        for group in mine:
            segments.setdefault(group, set()).add(segment)
    split = sorted(group for group, seen in segments.items() if len(seen) > 1)
    if split:
        raise RuntimeSetupError(f"stage {stage}'s plan gather group {split[0]} spans layers of different checkpoint "
                                f"regions or swapped runs, which the runtime runs apart; re-plan it with "
                                f"`tessera plan`")
    used = {index for _layer, _segment, indices in calls for index in indices}
    unread = sorted(name for group in gathers for name in group if by_name[name] not in used)
    if unread:
        raise RuntimeSetupError(f"stage {stage}'s plan gathers parameters {unread[:4]} by layer, but none of its "
                                f"layers reads them; re-plan it with `tessera plan`")
    return groups, group_of


def gathered_layers(module: nn.Module, state: StageOptimizer, read: Iterable[torch.Tensor],
                    params: Mapping[str, torch.Tensor], spec: OffloadSpec, *, stage: int) -> LayerGathers | None:
    """Install the group-by-group gathers on a ZeRO-3 stage whose graph reads the tensors ``read`` as inputs
    (get_attr parameters: those stay gathered for the whole pass), its parameters ``params`` by canonical name,
    in the groups of its plan's ``spec`` (none: a group per layer), each gathered ahead if it says so; None for
    any other stage."""
    if state.zero_stage != 3:
        return None
    names = {id(tensor): name for name, tensor in params.items()}
    layers = LayerGathers(module, state, read, names, spec.gathers, ahead=spec.prefetch, stage=stage)
    state.attach_layers(layers.covered, layers.end_pass)
    return layers
