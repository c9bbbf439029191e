"""Run a captured fx graph on fake tensors node by node: shapes, FLOPs and bytes saved for backward.

Nothing is allocated: parameters, buffers and inputs become FakeTensors, so a model built on the
meta device with 50B parameters is measured in seconds on a laptop. Each node runs in isolation
(its tensor inputs detached and re-attached to fresh leaves that require grad exactly when the
originals did), so its backward FLOPs are those the whole model's backward spends on it.
"""

from __future__ import annotations

import collections
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from cost_models.fake_memo import (Recording, ReplayedTensor, build_replayed, flatten_values,
                                   node_key, rebuild_output, record)
from cost_models.graph.ir import TensorMeta
from cost_models.graph.shapes import (VALUE_DEPENDENT, concrete_copy, crosses_boundary, dtype_name, fake_like,
                                      named_state, tensor_leaves, tensor_metas)


@dataclass(frozen=True)
class NodeMeasurement:
    """Per-node result of the fake run; a saved storage is attributed to the node that allocated it
    (``saved_bytes_by_dtype``), to the last node saving it (``released_bytes_by_dtype``) and to the first
    (``freed_bytes_by_dtype``)."""

    outputs: tuple[TensorMeta, ...]
    fwd_flops: int
    bwd_flops: int
    saved_bytes_by_dtype: tuple[tuple[str, int], ...]
    released_bytes_by_dtype: tuple[tuple[str, int], ...] = ()
    freed_bytes_by_dtype: tuple[tuple[str, int], ...] = ()
    crosses: bool = True  # the value can cross a stage boundary (shapes.crosses_boundary)


def storage_key(tensor: torch.Tensor | ReplayedTensor) -> int:
    return tensor.untyped_storage()._cdata


class StorageLedger:
    """Which node allocated each storage, and which nodes save the storages autograd keeps.

    Each saved storage is counted three times, in three ledgers: for its producer (what a stage holds: the
    node's output stays with the stage that made it, and a stage keeps the outputs it sent for their
    backward), for the last node that saves it (what recomputing or swapping that node releases:
    a checkpointed region drops only what its own nodes save, runtime/recompute.py, and a swapped node
    sends what it saves to the host, runtime/swap.py), and for the first (autograd frees it once that
    node's backward has run: the later savers' ran before). A GELU's output that the next Linear saves
    stays alive when the GELU is recomputed and the Linear is not; it is freed by the GELU's backward.
    """

    def __init__(self, param_tensors: Iterable[torch.Tensor]) -> None:
        self.param_keys = {storage_key(t) for t in param_tensors}
        self.producer: dict[int, str] = {}
        self.nbytes: dict[int, int] = {}
        self.alias: dict[int, int] = {}
        self.saver: dict[int, tuple[str, str]] = {}  # saved storage -> (the last node saving it, its dtype name)
        self.first_saver: dict[int, str] = {}  # saved storage -> the first node saving it
        self._alive: list[torch.Tensor] = []  # keeps every keyed storage alive so keys stay unique
        self._internal = 0

    def resolve(self, tensor: torch.Tensor | ReplayedTensor) -> int:
        key = storage_key(tensor)
        return self.alias.get(key, key)

    def add_alias(self, copy: torch.Tensor, original: torch.Tensor) -> None:
        """Treat ``copy``'s storage as ``original``'s (isolation clones stand in for their source)."""
        self.alias[storage_key(copy)] = self.resolve(original)
        self._alive.append(copy)

    def claim(self, tensor: torch.Tensor | ReplayedTensor, node: str) -> None:
        """Record ``node`` as the producer of ``tensor``'s storage unless one is known."""
        key = self.resolve(tensor)
        if key not in self.producer and key not in self.param_keys:
            self.producer[key] = node
            self.nbytes[key] = tensor.untyped_storage().nbytes()
            self._alive.append(tensor)

    def record_saved(self, tensor: torch.Tensor, node: str) -> None:
        self._alive.append(tensor)
        self.record_key(self.resolve(tensor), tensor.dtype, tensor.untyped_storage().nbytes(), node)

    def record_key(self, key: int, dtype: torch.dtype, nbytes: int, node: str) -> None:
        """``node`` saves storage ``key`` (``nbytes`` unless its producer said otherwise; ``node`` is its
        producer if none is known)."""
        if key in self.param_keys:
            return
        self.producer.setdefault(key, node)
        self.nbytes.setdefault(key, nbytes)
        self.saver[key] = (node, dtype_name(dtype))
        self.first_saver.setdefault(key, node)

    def record_internal(self, dtype: torch.dtype, nbytes: int, node: str) -> None:
        """A storage ``node`` allocated and autograd saved, re-counted without a tensor (replay)."""
        self._internal -= 1  # negative keys never collide with real storages
        self.record_key(self._internal, dtype, nbytes, node)

    def saved_bytes(self, by: str) -> dict[str, collections.Counter[str]]:
        """Per node, the bytes of the saved storages it produced (``by="producer"``), is the last to save
        (``"last"``) or the first (``"first"``), by dtype name."""
        saved: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for key, (last, dtype) in self.saver.items():
            node = {"producer": self.producer[key], "last": last, "first": self.first_saver[key]}[by]
            saved[node][dtype] += self.nbytes[key]
        return saved


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter, completed with the fused CPU attention kernels it has no formula for.

    On fake (and real) CPU tensors ``scaled_dot_product_attention`` dispatches to
    ``_scaled_dot_product_flash_attention_for_cpu``, which torch's registry lacks: it counted 0 FLOPs
    (about 18% of GPT-2-small's forward at sequence 1024). They get torch's own SDPA formulas, so
    the counts equal the math path's (tests/unit/test_cost_accuracy.py).
    """
    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
    })


def _attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                     **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_backward_flops(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any,
                              *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def measure_graph(module: torch.fx.GraphModule,
                  example_inputs: tuple[torch.Tensor, ...]) -> dict[str, NodeMeasurement]:
    """Measure every node of ``module`` on fake copies of ``example_inputs`` (values unused)."""
    with FakeTensorMode() as fake_mode:
        ledger = StorageLedger(())  # parameters join it as the runner makes their fakes
        runner = _FakeRunner(module, ledger, fake_mode)
        flops = runner.run(example_inputs)
    made, last, first = (ledger.saved_bytes(by) for by in ("producer", "last", "first"))
    return {name: NodeMeasurement(outputs, fwd, bwd, *(tuple(sorted(ledger_of.get(name, {}).items()))
                                                       for ledger_of in (made, last, first)),
                                  crosses=name not in runner.staying)
            for name, (outputs, fwd, bwd) in flops.items()}


class _FakeRunner:
    """Interprets the graph node by node on fake tensors.

    Parameters and buffers get their fakes when a node first needs them (what fake_state()
    would make, made lazily): a node replayed from the memo never reads them, so a model of
    repeated blocks makes fakes for its first block only.
    """

    def __init__(self, module: torch.fx.GraphModule, ledger: StorageLedger,
                 fake_mode: FakeTensorMode) -> None:
        self.module = module
        self.ledger = ledger
        self.fake_mode = fake_mode
        self.state_ids = {id(tensor) for _, tensor in named_state(module)}
        self.state: dict[int, torch.Tensor] = {}  # id() of a parameter or buffer -> its fake
        self.memo: dict[Any, Recording] = {}
        self.staying: set[str] = set()  # nodes whose values cannot cross a stage boundary (after run())

    def run(self, example_inputs: tuple[torch.Tensor, ...]) -> dict[str, tuple]:
        """Every node's (output TensorMetas, forward FLOPs, backward FLOPs)."""
        env: dict[str, Any] = {}
        results: dict[str, tuple] = {}
        inputs = iter(example_inputs)
        for node in self.module.graph.nodes:
            if node.op == "placeholder":
                value = self._fake_input(next(inputs), node.name)
            elif node.op == "get_attr":
                value = self._attribute(node.target)
            elif node.op == "output":
                value = None
            else:
                env[node.name], results[node.name] = self._call(node, env)
                value = env[node.name]  # a replayed node's tensors are ReplayedTensors
                if not (isinstance(value, ReplayedTensor) or crosses_boundary(value)):
                    self.staying.add(node.name)
                continue
            env[node.name] = value
            results[node.name] = (tensor_metas(value), 0, 0)
        return results

    def _fake_state(self, tensor: torch.Tensor) -> torch.Tensor:
        """The fake of a parameter or buffer of the model (tied aliases share one)."""
        fake = self.state.get(id(tensor))
        if fake is None:
            fake = self.state[id(tensor)] = fake_like(tensor)
            self.ledger.param_keys.add(storage_key(fake))
        return fake

    def _fake_input(self, value: torch.Tensor, name: str) -> torch.Tensor:
        fake = torch.empty(value.shape, dtype=value.dtype, device="cpu")
        self.ledger.claim(fake, name)
        return fake

    def _attribute(self, target: str) -> Any:
        value = operator.attrgetter(target)(self.module)
        if isinstance(value, torch.Tensor) and id(value) in self.state_ids:
            return self._fake_state(value)
        if isinstance(value, torch.Tensor):
            value = self.fake_mode.from_tensor(value)
            self.ledger.param_keys.add(storage_key(value))
        return value

    def _call(self, node: torch.fx.Node, env: dict[str, Any]) -> tuple[Any, tuple]:
        """The node's value and its (output TensorMetas, forward FLOPs, backward FLOPs)."""
        try:
            return self._call_fake(node, env)
        except VALUE_DEPENDENT:
            if node.op != "call_module":
                raise
            return self._call_concrete(node, env)

    def _call_fake(self, node: torch.fx.Node, env: dict[str, Any]) -> tuple[Any, tuple]:
        raw_args = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
        raw_kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        flat, nesting = flatten_values(raw_args, raw_kwargs)
        key = node_key(node, self.module, flat, nesting, self.ledger.param_keys)
        recording = None if key is None else self.memo.get(key)
        if recording is not None:
            return self._replay(recording, node.name, _tensor_inputs(flat))
        # This node runs, on FakeTensors: replayed inputs are built, and kept built in env so
        # that whatever the node does to them (an in-place op) later readers see.
        for source in node.all_input_nodes:
            env[source.name] = build_replayed(env[source.name], self.fake_mode)
        raw_args = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
        raw_kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        inputs = _tensor_inputs(flatten_values(raw_args, raw_kwargs)[0])  # indexed as a replay's
        leaves: list[torch.Tensor] = []
        isolate = self._isolator(leaves)
        args, kwargs = pytree.tree_map(isolate, raw_args), pytree.tree_map(isolate, raw_kwargs)
        function, params = self._callable(node)
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(self._packer(node.name, saved), lambda t: t):
            with flop_counter() as counter:
                output = function(*args, **kwargs)
        fwd_flops = counter.get_total_flops()
        for tensor in tensor_leaves(output):
            self.ledger.claim(tensor, node.name)
        bwd_flops = _backward_flops(output, leaves + params)
        if key is not None:
            self.memo[key] = record(inputs, output, saved, self.ledger.resolve, self.ledger.param_keys,
                                    fwd_flops, bwd_flops)
        value = detach_tree(output)
        return value, (tensor_metas(value), fwd_flops, bwd_flops)

    def _replay(self, recording: Recording, node: str,
                inputs: list[torch.Tensor | ReplayedTensor]) -> tuple[Any, tuple]:
        """An identical node was measured before: rebuild its outputs, re-attribute its saves."""
        output, leaves = rebuild_output(recording, inputs)
        for leaf in leaves:
            if isinstance(leaf, ReplayedTensor):
                self.ledger.claim(leaf, node)
        for ref in recording.saved:
            if ref.kind == "internal":
                self.ledger.record_internal(ref.dtype, ref.nbytes, node)
            elif ref.kind != "param":
                source = inputs[ref.index] if ref.kind == "input" else leaves[ref.index]
                self.ledger.record_key(self.ledger.resolve(source), ref.dtype, ref.nbytes, node)
        return output, (recording.metas, recording.fwd_flops, recording.bwd_flops)

    def _call_concrete(self, node: torch.fx.Node, env: dict[str, Any]) -> tuple[Any, tuple]:
        """A leaf whose forward branches on values: run it once on real zero-valued CPU tensors.

        Only that module is materialised (its weights zero-filled when they live on the meta
        device); the branch the zeros take is the one costed.
        """
        with unset_fake_temporarily():
            submodule = concrete_copy(self.module.get_submodule(node.target))
            self.ledger.param_keys.update(storage_key(t) for t in
                                          [*submodule.parameters(), *submodule.buffers()])
            leaves: list[torch.Tensor] = []

            def concrete(value: Any) -> Any:
                if not isinstance(value, torch.Tensor):
                    return value
                real = torch.zeros(value.shape, dtype=value.dtype)
                if value.requires_grad:
                    leaves.append(real.requires_grad_(True))
                    real = real.clone()
                self.ledger.add_alias(real, value)
                return real
            args = pytree.tree_map(concrete, torch.fx.node.map_arg(node.args, lambda n: env[n.name]))
            kwargs = pytree.tree_map(concrete, torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name]))
            with torch.autograd.graph.saved_tensors_hooks(self._packer(node.name), lambda t: t):
                with flop_counter() as counter:
                    output = submodule(*args, **kwargs)
            for tensor in tensor_leaves(output):
                self.ledger.claim(tensor, node.name)
            params = [p for p in submodule.parameters() if p.requires_grad]
            bwd_flops = _backward_flops(output, leaves + params)
            output = detach_tree(output)
        value = pytree.tree_map(self._to_fake, output)
        return value, (tensor_metas(value), counter.get_total_flops(), bwd_flops)

    def _to_fake(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        fake = self.fake_mode.from_tensor(value).requires_grad_(value.requires_grad)
        self.ledger.add_alias(fake, value)
        return fake

    def _isolator(self, leaves: list[torch.Tensor]) -> Callable[[Any], Any]:
        def isolate(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or not value.requires_grad:
                return value
            if storage_key(value) in self.ledger.param_keys:
                leaves.append(value)
                return value
            leaf = value.detach().requires_grad_(True)
            leaves.append(leaf)
            copy = leaf.clone()  # a non-leaf, so in-place ops (ReLU(inplace=True)) are legal
            self.ledger.add_alias(copy, value)
            return copy
        return isolate

    def _callable(self, node: torch.fx.Node) -> tuple[Callable[..., Any], list[torch.Tensor]]:
        if node.op == "call_module":
            submodule = self.module.get_submodule(node.target)
            local = {name: self._fake_state(t) for name, t in named_state(submodule)}
            params = [t for t in dict.fromkeys(local.values()) if t.requires_grad]

            def call_module(*args: Any, **kwargs: Any) -> Any:
                return torch.func.functional_call(submodule, local, args, kwargs)
            return call_module, params
        if node.op == "call_method":
            return (lambda self_arg, *args, **kwargs:
                    getattr(self_arg, node.target)(*args, **kwargs)), []
        return node.target, []

    def _packer(self, node_name: str, saved: list[torch.Tensor] | None = None
                ) -> Callable[[torch.Tensor], torch.Tensor]:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.ledger.record_saved(tensor, node_name)
            if saved is not None:
                saved.append(tensor)
            return tensor
        return pack


def _tensor_inputs(flat: list[Any]) -> list[Any]:
    """The tensors (FakeTensors or ReplayedTensors) among a node's flattened values."""
    return [leaf for leaf in flat if isinstance(leaf, (torch.Tensor, ReplayedTensor))]


def _backward_flops(output: Any, inputs: list[torch.Tensor]) -> int:
    targets = [t for t in tensor_leaves(output) if t.requires_grad and t.is_floating_point()]
    if not targets or not inputs:
        return 0
    with flop_counter() as counter:
        torch.autograd.grad(targets, inputs, [torch.empty_like(t) for t in targets],
                            allow_unused=True)
    return counter.get_total_flops()


def detach_tree(value: Any) -> Any:
    """``value`` with every tensor detached, keeping its requires_grad flag."""
    def detach(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().requires_grad_(leaf.requires_grad)
        return leaf
    return pytree.tree_map(detach, value)
