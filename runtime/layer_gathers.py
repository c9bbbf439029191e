"""ZeRO-3 layer by layer: a stage's sharded parameters gathered around each layer's forward and backward.

A stage whose parameters are sharded (ZeRO-3, runtime/stage_optimizer.py) holds only its chunk of each
between uses. Gathering the whole stage for every forward and backward would hold every parameter at once,
beside the whole gradients: no less than ZeRO-1 at the peak. Here each layer (a ``call_module`` of the stage's
graph that owns sharded parameters) gathers its own, as ZeRO-3 and FSDP do per wrapped block:

* before its forward (a forward pre-hook) the layer's parameters are all-gathered; after it (a forward hook)
  they are freed again;
* before its backward (a hook on its outputs' gradients, the first of them to arrive) they are gathered once
  more; when every one of them has its gradient (post-accumulate-grad hooks) that micro-batch's gradients are
  reduce-scattered at once, each rank adding its chunk to its shard's sum (``StageOptimizer.reduce_now``),
  and the parameters freed: no whole gradient outlives its layer's backward;
* a checkpointed region recomputes its layers' forwards inside the backward: their hooks gather and free
  again. Gathers are counted per parameter, so a layer whose backward holds its parameters keeps them through
  its own recompute.

Parameters no layer owns, or that the stage's graph also reads through ``get_attr`` (a weight tied within the
stage, as a GPT's embedding and head), keep the whole-pass gather of
``StageOptimizer.in_use``. Every replica of the stage runs the same graph, so the collectives come in the same
order on each. Why not FSDP2's ``fully_shard`` per layer: runtime/sharding.py's docstring (its DTensor
parameters replace the ones the executor and the optimizer tiers hold).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

if TYPE_CHECKING:
    from runtime.stage_optimizer import StageOptimizer


class LayerGathers:
    """The hooks that gather, free and reduce one ZeRO-3 stage's parameters layer by layer."""

    def __init__(self, module: torch.fx.GraphModule, state: StageOptimizer, read: Iterable[torch.Tensor]) -> None:
        self.state = state
        read_ids = {id(tensor) for tensor in read}  # fed to the graph as inputs: used outside any one layer
        index_of = {id(param): index for index, param in enumerate(state.params)
                    if index in state.param_shards and id(param) not in read_ids}
        self.layers: list[tuple[int, ...]] = []  # per layer: its sharded parameters' indices in the stage
        seen: set[int] = set()
        for node in module.graph.nodes:
            if node.op != "call_module":
                continue
            layer = module.get_submodule(node.target)
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            indices = tuple(sorted({index_of[id(p)] for p in layer.parameters() if id(p) in index_of}))
            if indices:
                self._hook(layer, len(self.layers))
                self.layers.append(indices)
        self.covered = frozenset(index for layer in self.layers for index in layer)
        self._layers_of: dict[int, list[int]] = {}
        for k, layer in enumerate(self.layers):
            for index in layer:
                self._layers_of.setdefault(index, []).append(k)
        for index in self.covered:
            if state.params[index].requires_grad:
                state.params[index].register_post_accumulate_grad_hook(functools.partial(self._grad_made, index))
        self._held = [0] * len(self.layers)  # backward gathers not yet released, per layer
        self._waiting: list[set[int]] = [set() for _ in self.layers]  # per layer: gradients its backward awaits

    def _hook(self, layer: nn.Module, k: int) -> None:
        layer.register_forward_pre_hook(functools.partial(self._before_forward, k))
        layer.register_forward_hook(functools.partial(self._after_forward, k))

    def _before_forward(self, k: int, _layer: nn.Module, _args: Any) -> None:
        self.state.gather(self.layers[k])

    def _after_forward(self, k: int, _layer: nn.Module, _args: Any, output: Any) -> None:
        self.state.release(self.layers[k])
        outputs = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(outputs, functools.partial(self._before_backward, k),
                                                          mode="any")

    def _before_backward(self, k: int, _grad: Any) -> None:
        self.state.gather(self.layers[k])
        self._held[k] += 1
        self._waiting[k] = {index for index in self.layers[k] if self.state.params[index].requires_grad}

    def _grad_made(self, index: int, _param: torch.Tensor) -> None:
        for k in self._layers_of[index]:
            waiting = self._waiting[k]
            if index in waiting:
                waiting.discard(index)
                if not waiting:
                    self._backward_done(k)

    def _backward_done(self, k: int) -> None:
        """Layer ``k``'s gradients of this micro-batch reduce-scattered, its parameters freed."""
        self.state.reduce_now([index for index in self.layers[k] if self.state.params[index].grad is not None])
        if self._held[k]:
            self._held[k] -= 1
            self.state.release(self.layers[k])

    def end_pass(self) -> None:
        """After a forward or backward: release what a layer's backward still holds where it made no gradient for
        some parameter (those it made are reduced with the whole-pass ones at ALLREDUCE), or where the layer ran
        twice (its second gather outlives the one completion of its gradients)."""
        for k, held in enumerate(self._held):
            for _ in range(held):
                self.state.release(self.layers[k])
            self._held[k] = 0
            self._waiting[k] = set()


def gathered_layers(module: torch.fx.GraphModule, state: StageOptimizer,
                    read: Iterable[torch.Tensor]) -> LayerGathers | None:
    """Install the layer-by-layer gathers on a ZeRO-3 stage whose graph reads the tensors ``read`` as inputs
    (get_attr parameters: those stay gathered for the whole pass); None for any other stage."""
    if state.zero_stage != 3:
        return None
    layers = LayerGathers(module, state, read)
    state.attach_layers(layers.covered, layers.end_pass)
    return layers
