"""profile(): measure real per-node forward/backward times (and CUDA memory), cached as JSON."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import operator
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from cost_models.allocations import allocation_profiler, peaks_within
from cost_models.cpu_device import rank_cores
from cost_models.device_spec import CALIBRATED
from cost_models.devices import DeviceSpec, cache_root, get_device
from cost_models.errors import ProfileError
from cost_models.estimation import CostTable, estimate
from cost_models.fake_measure import detach_tree
from cost_models.fake_memo import callee_key
from cost_models.graph.shapes import tensor_leaves
from cost_models.loss import TrainingLoss, training_loss

if TYPE_CHECKING:
    from cost_models.graph.ir import LayerGraph

_CACHE_VERSION = 13  # 2: node times scaled to the whole graph's measured pass; 3: from a cold cache; 4: the loss;
# 5: split backwards; 6: what each backward allocates; 7: interleaved rounds; 8: less a backward call's own cost;
# 9: that call through a clone, as a node's isolated input; 10: split halves scaled to a whole split backward;
# 11: a node's split halves timed warm; 12: a split backward's W pays a fixed cost per weight group, and
# the copies training beside the profile sit where the run's ranks do; 13: nodes of one signature pool their samples
_EVICT_BYTES = 64 * 2**20  # written before a pass timed from a cold cache: more than a CPU's last-level cache
_BACKWARD_LABEL = "tessera.backward:"  # the profiler range of each node's backward whose allocations are measured
_CO_RUNNER_START_S = 60.0  # for the co-running copies to start (they fork from this process) and to stop


@dataclass(frozen=True)
class NodeTiming:
    """Median forward and backward milliseconds of one node, its CUDA forward peak, the most its backward
    allocates (its inputs' and weights' gradients, the kernel's workspace: oneDNN's convolution takes
    two more inputs' worth), and for a node with both weights and inputs that carry a gradient, its
    backward split in two as ZB-H1 runs it: I (the inputs' gradients) then W (the weights')."""

    fwd_ms: float
    bwd_ms: float
    fwd_peak_bytes: int | None = None
    split_ms: tuple[float, float] | None = None
    bwd_bytes: int | None = None


@dataclass(frozen=True)
class _Sample:
    """One round's figures of one node: forward and backward milliseconds (None: nothing to differentiate),
    CUDA's forward peak and backward bytes, and the split backward's I and W milliseconds where timed."""

    fwd_ms: float
    bwd_ms: float | None
    fwd_peak_bytes: int | None
    bwd_bytes: int | None
    split_ms: tuple[float, float] | None


@dataclass(frozen=True)
class _Loss:
    """The training loss after a model's output, with targets to time it on."""

    function: TrainingLoss
    target: torch.Tensor

    @classmethod
    def after(cls, output: Any) -> _Loss | None:
        """The loss after ``output``; None when the model does not return one float tensor."""
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        function = training_loss(tuple(output.shape), output.dtype)
        return cls(function, function.example_target(output.device))


@dataclass
class _NodeSamples:
    """A node's samples over the profile's rounds (only those kept after the warm-up rounds)."""

    fwd_ms: list[float] = dataclasses.field(default_factory=list)
    bwd_ms: list[float] = dataclasses.field(default_factory=list)
    inputs_ms: list[float] = dataclasses.field(default_factory=list)
    weights_ms: list[float] = dataclasses.field(default_factory=list)
    last: _Sample | None = None

    def add(self, sample: _Sample, kept: bool, split_kept: bool) -> None:
        self.last = sample
        if kept:
            self.fwd_ms.append(sample.fwd_ms)
            if sample.bwd_ms is not None:
                self.bwd_ms.append(sample.bwd_ms)
        if split_kept and sample.split_ms is not None:
            self.inputs_ms.append(sample.split_ms[0])
            self.weights_ms.append(sample.split_ms[1])

    def pooled(self, others: Sequence[_NodeSamples]) -> _NodeSamples:
        """These samples with those of ``others`` (nodes of the same signature: the same call on the same
        shapes), this node's last sample kept for its bytes."""
        every = [self, *others]
        return _NodeSamples([t for n in every for t in n.fwd_ms], [t for n in every for t in n.bwd_ms],
                            [t for n in every for t in n.inputs_ms], [t for n in every for t in n.weights_ms],
                            self.last)

    def timing(self, call_ms: float) -> NodeTiming:
        """The medians (a node without a backward: 0 ms), each backward less ``call_ms``, what starting a
        backward alone costs (a whole pass pays it once, not per node); the last round's bytes."""
        assert self.last is not None and self.fwd_ms, "a node timed in no kept round"

        def backward(samples: list[float]) -> float:
            return max(statistics.median(samples) - call_ms, 0.0)
        split = (backward(self.inputs_ms), backward(self.weights_ms)) if self.inputs_ms else None
        return NodeTiming(statistics.median(self.fwd_ms), backward(self.bwd_ms) if self.bwd_ms else 0.0,
                          self.last.fwd_peak_bytes, split, self.last.bwd_bytes)


def profile(model: nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor],
            device: str = "cpu", *, optimizer: str = "adam", precision: str | None = None,
            warmup: int = 2, repeats: int = 5, cache_dir: str | Path | None = None,
            refresh: bool = False, leaf_modules: Sequence[type | str] = (), co_runners: int = 0) -> CostTable:
    """Cost table of ``model`` with forward/backward times measured node by node.

    ``device`` is where to measure: ``"cpu"``, ``"cuda"``/``"cuda:N"``, or a GPU preset name
    (measured on the local GPU, labelled with the preset). The model and inputs must already
    live there. Each node runs ``warmup`` + ``repeats`` times on its real inputs, once in each of as many
    rounds over the graph (a slow spell of the machine then touches one or two of a node's samples, not all),
    and the median of the rounds after the warm-up is kept. A node timed alone misses what it costs inside
    the whole pass (caches, the autograd engine's work between nodes, on CUDA the launch queue instead of a
    synchronisation per node), so the whole graph's forward and backward, with the training loss after it,
    are timed once a round too and each node's times are scaled so that they sum to them: the node keeps its
    share, the total is what a stage really runs. On the CPU the rounds run while ``co_runners`` copies of
    the graph train on other cores (:func:`co_running`), as the other ranks of a node do: they share its
    memory bandwidth and last-level cache. The output node gets the training loss's times
    (cost_models/loss.py), which the last stage runs after the model. With ``cache_dir`` the timings are
    stored as JSON keyed by graph fingerprint, device and dtype, and reused unless ``refresh``. Memory
    columns come from the fake-tensor measurement; on CUDA each node's measured forward peak is recorded too.

    Example::

        table = profile(resnet50(device="cpu"), (torch.randn(8, 3, 64, 64),), "cpu",
                        cache_dir="~/.cache/tessera/profiles")
        table["conv1"].fwd_ms
    """
    return profile_with_graph(model, example_inputs, device, optimizer=optimizer,
                              precision=precision, warmup=warmup, repeats=repeats,
                              cache_dir=cache_dir, refresh=refresh, leaf_modules=leaf_modules,
                              co_runners=co_runners)[1]


def profile_with_graph(model: nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor],
                       device: str = "cpu", *, optimizer: str = "adam", precision: str | None = None,
                       warmup: int = 2, repeats: int = 5, cache_dir: str | Path | None = None,
                       refresh: bool = False, leaf_modules: Sequence[type | str] = (), co_runners: int = 0
                       ) -> tuple[LayerGraph, CostTable]:
    """profile() that also returns the traced graph the table describes."""
    from cost_models.graph.tracing import normalise_inputs, trace_module  # planner builds on cost_models

    if warmup < 0 or repeats < 1:
        raise ProfileError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup}, "
                           f"repeats={repeats}")
    torch_device, spec = _resolve_device(device)
    inputs = normalise_inputs(example_inputs)
    _check_placement(model, inputs, torch_device)
    graph, module = trace_module(model, inputs, leaf_modules)
    dtype = _model_dtype(model)
    co_runners = co_runners if torch_device.type == "cpu" else 0
    cache_file = _cache_path(cache_dir, graph.fingerprint, spec.name, dtype, co_runners)
    timings = None if refresh or cache_file is None else _read_cache(cache_file, graph.fingerprint)
    if timings is None:
        timings = _NodeProfiler(module, torch_device, warmup, repeats, co_runners).run(inputs)
        if cache_file is not None:
            _write_cache(cache_file, graph.fingerprint, spec.name, dtype, timings)
    table = estimate(graph, spec, optimizer, precision)
    costs = tuple(dataclasses.replace(cost, fwd_ms=timings[cost.name].fwd_ms,
                                      bwd_ms=timings[cost.name].bwd_ms,
                                      measured_fwd_peak_bytes=timings[cost.name].fwd_peak_bytes,
                                      split_ms=timings[cost.name].split_ms,
                                      measured_bwd_bytes=timings[cost.name].bwd_bytes)
                  if cost.name in timings else cost for cost in table.costs)
    return graph, dataclasses.replace(table, costs=costs, source="measured")


def measured_table(model: nn.Module, graph: LayerGraph, example_inputs: Sequence[torch.Tensor],
                   batch_size: int, *, optimizer: str, precision: str, co_runners: int = 0,
                   cache_dir: str | Path | None = None, device: DeviceSpec | None = None,
                   leaf_modules: Sequence[type | str] = ()) -> CostTable:
    """``graph``'s costs at micro-batch ``batch_size`` (estimate()) with every node's forward and backward
    time measured where ``model`` is, at that batch (profile(), cached): what plan() costs a measured plan with.

    ``example_inputs`` give each input's sample shape and dtype (any device; meta is fine): the profile
    runs on random floats (in the model's dtype) and zero integers (token ids) of that batch. On the CPU
    it runs on one intra-op thread as the runtime's CPU ranks compute (torchrun gives each one), beside
    ``co_runners`` copies training on other cores (the node's other ranks: profile()); the model is
    already in the dtype the runtime computes in (:func:`in_compute_dtype`). ``device`` is
    the spec the rest of the table is costed for (memory, transfers; default: the measured device's).
    ``cache_dir`` defaults to the ``profiles`` folder of :func:`cost_models.devices.cache_root`; ``leaf_modules``
    are the ones ``graph`` was traced with."""
    where = next(iter(model.parameters())).device
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    # floats enter a 16-bit model in 16 bits, as the runtime casts them (on a GPU always in the model's)
    float_dtype = model_dtype if where.type != "cpu" or model_dtype.itemsize == 2 else None
    generator = torch.Generator().manual_seed(0)
    inputs = tuple(torch.randn((batch_size, *x.shape[1:]), generator=generator, dtype=x.dtype).to(
                       where, float_dtype or x.dtype)
                   if x.is_floating_point() else torch.zeros((batch_size, *x.shape[1:]), dtype=x.dtype, device=where)
                   for x in example_inputs)
    threads = torch.get_num_threads()
    if where.type == "cpu":
        torch.set_num_threads(1)
    measured_on = "cpu" if where.type == "cpu" else str(where)
    spec, folder = _resolve_device(measured_on)[1], cache_dir or cache_root() / "profiles"
    try:
        # the profile's own cache is keyed by the graph captured at this batch, which takes a capture (torch.export
        # for a Hugging Face model: 2 s a batch size, 8 of a warm 12 s plan); this one by the planned graph's
        alias = _planned_alias(graph.fingerprint, batch_size)
        alias_file = _cache_path(folder, alias, spec.name, _model_dtype(model), co_runners)
        timings = _read_cache(alias_file, alias) if alias_file is not None else None
        if timings is None:
            _, measured = profile_with_graph(model, inputs, measured_on, optimizer=optimizer, precision=precision,
                                             cache_dir=folder, co_runners=co_runners, leaf_modules=leaf_modules)
            timings = {cost.name: NodeTiming(cost.fwd_ms, cost.bwd_ms, cost.measured_fwd_peak_bytes, cost.split_ms,
                                             cost.measured_bwd_bytes) for cost in measured.costs}
            if alias_file is not None:
                _write_cache(alias_file, alias, spec.name, _model_dtype(model), timings)
    except torch.cuda.OutOfMemoryError as error:
        raise ProfileError(f"timing the whole model at micro-batch {batch_size} ran out of {where}'s memory; "
                           f"plan with profile=False (--no-profile: roofline costs), or with smaller "
                           f"micro_batch_sizes (--micro-batch-size)") from error
    finally:
        torch.set_num_threads(threads)
    table = estimate(graph, device or spec, optimizer, precision, batch_size=batch_size)
    unmatched = [cost.name for cost in table.costs if cost.name not in timings]
    if unmatched:
        raise ProfileError(f"the profiled graph at batch {batch_size} has no node {unmatched[0]!r} of the "
                           f"planned graph ({len(unmatched)} missing); plan with profile=False (--no-profile: "
                           f"roofline costs)")
    return dataclasses.replace(table, costs=tuple(
        dataclasses.replace(cost, fwd_ms=timings[cost.name].fwd_ms, bwd_ms=timings[cost.name].bwd_ms,
                            split_ms=timings[cost.name].split_ms, measured_bwd_bytes=timings[cost.name].bwd_bytes)
        for cost in table.costs), source="measured")


def _planned_alias(fingerprint: str, batch_size: int) -> str:
    """The cache key of a planned graph's profile at ``batch_size`` (the graph profiled is captured at that batch)."""
    return hashlib.sha256(f"{fingerprint}@batch{batch_size}".encode()).hexdigest()


def local_gpu(device: DeviceSpec) -> torch.device | None:
    """This machine's CUDA device that ``device`` describes (its preset, or a calibration of it), or None."""
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        here = torch.device("cuda", index)
        try:
            preset = _preset_for_local_gpu(here)
        except ProfileError:
            continue
        if device.name in (preset.name, preset.name + CALIBRATED):
            return here
    return None


def in_compute_dtype(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``model`` (real weights) on ``device`` with its floating-point tensors in ``dtype``, the dtype the
    runtime computes in (a 16-bit plan computes on a 16-bit copy of fp32 master weights): a copy, or the
    model itself where it is already so (a CPU plan in the dtype it was built in)."""
    import copy

    floats = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    if all(t.device == device and t.dtype == dtype for t in floats):
        return model
    try:
        return copy.deepcopy(model).to(device, dtype)
    except torch.cuda.OutOfMemoryError as error:
        raise ProfileError(f"the model's weights in {str(dtype).removeprefix('torch.')} do not fit {device} to "
                           f"time it there; plan with profile=False (roofline costs)") from error


def _resolve_device(device: str) -> tuple[torch.device, DeviceSpec]:
    if device == "cpu":
        return torch.device("cpu"), get_device("cpu")
    if not torch.cuda.is_available():
        raise ProfileError(f"cannot profile on {device!r}: CUDA is not available on this machine; "
                           f"profile on 'cpu', or estimate GPU costs with estimate(graph, "
                           f"device={device!r})")
    if device.startswith("cuda"):
        torch_device = torch.device(device)
        return torch_device, _preset_for_local_gpu(torch_device)
    return torch.device("cuda"), get_device(device)


def _preset_for_local_gpu(device: torch.device) -> DeviceSpec:
    """The preset matching the local GPU's name and memory (e.g. "NVIDIA H100 80GB HBM3")."""
    from cost_models.devices import PRESETS

    properties = torch.cuda.get_device_properties(device)
    for preset in PRESETS.values():
        family = preset.name.split("-")[0]
        if family in properties.name and abs(properties.total_memory / preset.mem_bytes - 1) < 0.12:
            return preset
    raise ProfileError(f"the local GPU {properties.name!r} "
                       f"({properties.total_memory / 2**30:.0f} GiB) matches no preset; pass a "
                       f"preset name or a device JSON file as device= to label the measurement")


def _check_placement(model: nn.Module, inputs: tuple[torch.Tensor, ...], device: torch.device) -> None:
    tensors = [*model.parameters(), *model.buffers(), *inputs]
    wrong = sorted({str(t.device) for t in tensors if t.device.type != device.type})
    if wrong:
        hint = ("build it on a real device (e.g. builder(device='cpu'))" if "meta" in wrong
                else f"move it with model.to('{device}')")
        raise ProfileError(f"profile needs the model and inputs on {device}, found tensors on "
                           f"{', '.join(wrong)}; {hint}")


def _model_dtype(model: nn.Module) -> str:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return "float32"


class _NodeProfiler:
    """Times each node on its real inputs, and the whole graph, in interleaved rounds; then scales the node
    times to the whole graph's.

    A round runs every node once (its forward, its backward, on a round of the first few its split backward) and
    then the whole graph's forward and backward once; the first ``warmup`` rounds are dropped and each figure is
    the median over the rest. A node's samples are thus spread over the whole profile instead of taken back to
    back: a slow spell of the machine (a shared VM's cores slow down by up to 1.7x for a second or more) costs
    each node at most the one or two samples of the rounds it falls on, where back to back it would have taken
    every sample of the nodes timed during it, skewing their shares and with them the partition."""

    def __init__(self, module: torch.fx.GraphModule, device: torch.device, warmup: int,
                 repeats: int, co_runners: int = 0) -> None:
        self.module = module
        self.device = device
        self.warmup = warmup
        self.repeats = repeats
        self.co_runners = co_runners
        self._evict = torch.empty(_EVICT_BYTES // 4) if device.type == "cpu" else None  # written to cool the cache

    def run(self, inputs: tuple[torch.Tensor, ...]) -> dict[str, NodeTiming]:
        buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        grads = {param: param.grad for param in self.module.parameters()}
        for param in grads:
            param.grad = None  # the whole passes' gradients go into fresh ones
        try:
            with co_running(self.module, inputs, self.co_runners):
                alone, whole_fwd_ms, whole_bwd_ms, whole_split = self._rounds(inputs)
            # (CUDA's allocator gave each its peak as it was timed; a caller's own profiler session, which a
            # second would end, leaves the backwards' bytes estimated)
            if self.device.type == "cpu" and not torch.autograd.profiler._is_profiler_enabled:
                allocated = self._cpu_backward_bytes(inputs)
                alone = {name: dataclasses.replace(t, bwd_bytes=allocated.get(name)) for name, t in alone.items()}
            return in_context(alone, whole_fwd_ms, whole_bwd_ms, whole_split)
        finally:
            with torch.no_grad():
                for name, b in self.module.named_buffers():
                    b.copy_(buffers[name])
            for param, grad in grads.items():
                param.grad = grad

    def _rounds(self, inputs: tuple[torch.Tensor, ...]
                ) -> tuple[dict[str, NodeTiming], float, float, WholeSplit | None]:
        """Each node's median times over the rounds, the whole graph's median forward and backward, and its
        split backward's (where one was timed)."""
        samples: dict[str, _NodeSamples] = {}
        signatures: dict[str, tuple | None] = {}  # what each node's times depend on (_signature)
        whole_fwd, whole_bwd, call_ms = [], [], []
        whole_splits: list[WholeSplit] = []
        output_node = next(node for node in self.module.graph.nodes if node.op == "output")
        loss: _Loss | None = None  # known from the first round's output
        split_rounds = min(self.warmup, 1) + min(self.repeats, 3)  # a figure only split backwards' schedules read
        for index in range(self.warmup + self.repeats):
            kept = index >= self.warmup
            splits: dict[tuple, tuple[float, float]] = {}  # by _signature: repeated layers timed once a round

            def timed(node: torch.fx.Node, env: dict[str, Any], kept: bool = kept, index: int = index,
                      splits: dict = splits) -> Any:
                if node.name not in signatures:
                    arguments = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
                    signatures[node.name] = _signature(node, self.module, arguments)
                output, sample = self._time_once(node, env, splits if index < split_rounds else None)
                record = samples.setdefault(node.name, _NodeSamples())
                record.add(sample, kept, split_kept=min(self.warmup, 1) <= index < split_rounds)
                if kept and sample.bwd_ms is not None:  # in the same state as the node's own backward
                    call_ms.append(self._backward_call_ms())
                return output

            output = self._each_node(inputs, timed)
            loss = _Loss.after(output) if index == 0 else loss
            if loss is not None:
                samples.setdefault(output_node.name, _NodeSamples()).add(self._loss_once(output, loss), kept, False)
            fwd_ms, bwd_ms = self._whole_graph_once(inputs, loss)
            if kept:
                whole_fwd.append(fwd_ms)
                if bwd_ms is not None:
                    whole_bwd.append(bwd_ms)
            if min(self.warmup, 1) <= index < split_rounds:
                split = self._whole_split_once(inputs, loss)
                whole_splits += [split] if split is not None else []
        call = statistics.median(call_ms)
        alone = {name: record.timing(call) for name, record in _pooled(samples, signatures).items()}
        whole_split = None
        if whole_splits:
            whole_split = dataclasses.replace(
                whole_splits[0], input_ms=statistics.median(split.input_ms for split in whole_splits),
                weight_ms=statistics.median(split.weight_ms for split in whole_splits))
        return (alone, statistics.median(whole_fwd), statistics.median(whole_bwd) if whole_bwd else 0.0,
                whole_split)

    def _each_node(self, inputs: tuple[torch.Tensor, ...],
                   compute: Callable[[torch.fx.Node, dict[str, Any]], Any]) -> Any:
        """Run the graph on ``inputs`` node by node: ``compute(node, env)`` returns each call's output from
        the values before it (``env``, by node name); returns the graph's output."""
        env: dict[str, Any] = {}
        feed = iter(inputs)
        for node in self.module.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = next(feed)
            elif node.op == "get_attr":
                env[node.name] = operator.attrgetter(node.target)(self.module)
            elif node.op == "output":
                return torch.fx.node.map_arg(node.args[0], lambda n: env[n.name])
            else:
                env[node.name] = compute(node, env)
        return None

    def _cpu_backward_bytes(self, inputs: tuple[torch.Tensor, ...]) -> dict[str, int]:
        """Per node with a backward, the most that backward allocates on the CPU: each node's forward and
        backward run once more, on its real inputs, under one profiler session (not timed)."""
        def backward_once(node: torch.fx.Node, env: dict[str, Any]) -> Any:
            function, params = _real_callable(node, self.module)
            args, kwargs, leaves = _isolate(*torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name]))
            output = function(*args, **kwargs)
            targets = [t for t in tensor_leaves(output) if t.requires_grad and t.is_floating_point()]
            if targets and leaves + params:
                grads = [torch.ones_like(t) for t in targets]
                with torch.profiler.record_function(_BACKWARD_LABEL + node.name):
                    torch.autograd.grad(targets, leaves + params, grads, allow_unused=True)
            return detach_tree(output)

        with allocation_profiler() as run:
            self._each_node(inputs, backward_once)
        return peaks_within(run, _BACKWARD_LABEL)

    def _whole_graph_once(self, inputs: tuple[torch.Tensor, ...], loss: _Loss | None) -> tuple[float, float | None]:
        """Milliseconds of the whole graph's forward (with the training ``loss`` after it, if any) and of its
        backward into the weights (None without one), each from a cold CPU cache (in a training step other
        micro-batches' work runs in between)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self._evict is not None:
            self._evict.fill_(1.0)
        fwd_ms, output, _ = self._timed(lambda: self.module(*inputs) if loss is None
                                        else loss.function(self.module(*inputs), loss.target))
        targets = [t for t in tensor_leaves(output) if t.requires_grad and t.is_floating_point()]
        if not (targets and params):
            return fwd_ms, None
        grads = [torch.ones_like(t) for t in targets]
        if self._evict is not None:
            self._evict.fill_(1.0)
        # into the weights' .grad, as a stage's backward adds each micro-batch's (run() puts theirs back)
        return fwd_ms, self._timed(lambda: torch.autograd.backward(targets, grads, inputs=params))[0]

    def _whole_split_once(self, inputs: tuple[torch.Tensor, ...], loss: _Loss | None) -> WholeSplit | None:
        """The graph after its first node as a later pipeline stage splits its backward (ZB-H1): the first
        node's output received as a leaf, the forward run on, then I (the leaf's gradient, keeping what each
        weight group needs) and W (the weights' gradients, group by group) timed with torch's functions,
        each from a cold CPU cache: the runtime's W (runtime/split_backward.py, not imported by the cost
        models) runs the same per-group backwards, keeping the graph between groups as this does. None where no
        floating value leaves a first node, or the groups its gradient reaches miss a weight after it."""
        # imported here: torch.distributed.pipelining imports dynamo, about 2 s that every `tessera` command
        # and `import planner` paid, profiling or not
        from torch.distributed.pipelining._backward import (
            _get_grad_fn_or_grad_acc,
            construct_reverse_graph,
            stage_backward_input,
            stage_backward_weight,
        )

        cut: dict[str, torch.Tensor] = {}

        class Received(torch.fx.Interpreter):
            def run_node(self, node: torch.fx.Node) -> Any:
                output = super().run_node(node)
                if (not cut and node.op.startswith("call_") and isinstance(output, torch.Tensor)
                        and output.is_floating_point()):
                    cut[node.name] = output = output.detach().requires_grad_(True)
                return output

        output = Received(self.module).run(*inputs)
        if loss is not None:
            output = loss.function(output, loss.target)
        targets = [t for t in tensor_leaves(output) if t.requires_grad and t.is_floating_point()]
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not (cut and targets and params):
            return None
        (first, leaf), = cut.items()
        roots = [t.clone() for t in targets]  # stage_backward_input detaches its roots in place
        reverse = construct_reverse_graph([root.grad_fn for root in roots])
        reached = {node for node in map(_get_grad_fn_or_grad_acc, params) if node in reverse}
        grads = None if loss is not None else [torch.ones_like(t) for t in targets]
        if self._evict is not None:
            self._evict.fill_(1.0)
        try:
            input_ms, (_, groups), _ = self._timed(lambda: stage_backward_input(roots, grads, [leaf], iter(params)))
        except RuntimeError:  # a graph torch's split cannot take: the halves keep the backward's scale
            return None
        if not groups or reached - set().union(*(group["params"] for group in groups)):
            return None  # a weight the leaf's groups miss: what follows the first node is no stage's graph
        if self._evict is not None:
            self._evict.fill_(1.0)
        weight_ms = self._timed(lambda: stage_backward_weight(iter(params), groups, retain_graph=True))[0]
        return WholeSplit(first, input_ms, weight_ms)

    def _backward_call_ms(self) -> float:
        """What a node's backward started alone costs beyond its own work: one through a view of a clone of a leaf
        (a node's isolated input, :func:`_isolate`), whose work is next to none (on the CPU 15-30 us, against 1-3
        us a node inside a whole pass; in a GPT's profile it made up a quarter of the nodes' backward times, and
        more of the stages with many small nodes: their share of the step came out too large)."""
        leaf = torch.zeros(16, device=self.device, requires_grad=True)
        view, grad = leaf.clone().view(4, 4), torch.ones(4, 4, device=self.device)  # a node's input: _isolate's
        return self._timed(lambda: torch.autograd.grad(view, leaf, grad))[0]

    def _loss_once(self, output: torch.Tensor, loss: _Loss) -> _Sample:
        """One forward and backward of the training loss on the model's ``output`` (cost_models/loss.py), which
        the last stage runs after the model on each micro-batch."""
        logits = output.detach().requires_grad_(True)
        fwd_ms, value, _ = self._timed(lambda: loss.function(logits, loss.target))
        return _Sample(fwd_ms, self._timed(lambda: torch.autograd.grad(value, logits))[0], None, None, None)

    def _time_once(self, node: torch.fx.Node, env: dict[str, Any],
                   splits: dict[tuple, tuple[float, float]] | None) -> tuple[Any, _Sample]:
        """One forward and one backward of ``node`` on its inputs in ``env``; with ``splits`` (this round's, by
        signature) also its backward split into I and W where it has both inputs and weights to differentiate."""
        function, params = _real_callable(node, self.module)
        args = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        call_args, call_kwargs, leaves = _isolate(args, kwargs)
        fwd_ms, output, peak_bytes = self._timed(lambda: function(*call_args, **call_kwargs))
        targets = [t for t in tensor_leaves(output) if t.requires_grad and t.is_floating_point()]
        wrt = leaves + params
        if not (targets and wrt):
            return detach_tree(output), _Sample(fwd_ms, None, peak_bytes, None, None)
        grads = [torch.ones_like(t) for t in targets]
        inputs = [leaf for leaf in leaves if not isinstance(leaf, nn.Parameter)]
        weights = [leaf for leaf in leaves if isinstance(leaf, nn.Parameter)] + params  # a get_attr's too
        split = None
        if splits is not None and inputs and weights:
            key = _signature(node, self.module, (args, kwargs))
            split = splits.get(key) if key is not None else None
            if split is None:
                split = self._split_once(targets, grads, inputs, weights)
                if key is not None:
                    splits[key] = split
        bwd_ms, _, bwd_bytes = self._timed(lambda: torch.autograd.grad(targets, wrt, grads, allow_unused=True))
        return detach_tree(output), _Sample(fwd_ms, bwd_ms, peak_bytes, bwd_bytes, split)

    def _split_once(self, targets: list[torch.Tensor], grads: list[torch.Tensor], inputs: list[torch.Tensor],
                    weights: list[torch.Tensor]) -> tuple[float, float]:
        """Milliseconds of I (into ``inputs``) and of W (into ``weights``), warm as the node's other times: the
        graph's own split backward, timed from a cold cache, scales them (:func:`in_context`; a node's W alone
        from a cold cache came out 3x its I, where the graph's W is about its I)."""
        input_ms = self._timed(lambda: torch.autograd.grad(targets, inputs, grads, retain_graph=True,
                                                           allow_unused=True))[0]
        return input_ms, self._timed(lambda: torch.autograd.grad(targets, weights, grads, retain_graph=True,
                                                                 allow_unused=True))[0]

    def _timed(self, work: Callable[[], Any]) -> tuple[float, Any, int | None]:
        if self.device.type != "cuda":
            start = time.perf_counter()
            result = work()
            return (time.perf_counter() - start) * 1e3, result, None
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        result = work()
        torch.cuda.synchronize(self.device)
        elapsed = (time.perf_counter() - start) * 1e3
        return elapsed, result, torch.cuda.max_memory_allocated(self.device) - base


@contextlib.contextmanager
def co_running(module: nn.Module, inputs: tuple[torch.Tensor, ...], copies: int) -> Iterator[list[int]]:
    """``copies`` forked processes training ``module`` on ``inputs`` (forward, backward into the weights) until
    the block ends; yields their pids. They and this process sit where the runtime binds ``copies + 1`` local
    ranks (cost_models.cpu_device.rank_cores): this process on rank 0's share of the cores, copy i on rank
    i + 1's, so that the profile shares caches, memory channels and any sibling cores as the run's ranks will
    (copies on the cores next to this one were a placement no run has: 4 ranks on 16 cores run on cores
    0-3, 4-7, 8-11 and 12-15). Where the machine has fewer cores than that, the copies share what there is
    (as the ranks would)."""
    if copies <= 0:
        yield []
        return
    context = multiprocessing.get_context("fork")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    shares = [rank_cores(cores, rank, copies + 1) for rank in range(copies + 1)]
    if shares[0] is not None:
        os.sched_setaffinity(0, shares[0])
    stop, started = context.Event(), context.Barrier(copies + 1)
    runners = [context.Process(target=_train_until, args=(module, inputs, stop, started, shares[1 + index]),
                               daemon=True) for index in range(copies)]
    try:
        for runner in runners:
            runner.start()
        with contextlib.suppress(threading.BrokenBarrierError):  # a copy that failed to start: time without it
            started.wait(timeout=_CO_RUNNER_START_S)
        yield [runner.pid for runner in runners if runner.pid is not None]
    finally:
        stop.set()
        for runner in runners:
            runner.join(timeout=_CO_RUNNER_START_S)
            if runner.is_alive():
                runner.kill()
        if cores:
            os.sched_setaffinity(0, set(cores))


def _train_until(module: nn.Module, inputs: tuple[torch.Tensor, ...], stop: Any, started: Any,
                 cores: Sequence[int] | None) -> None:
    """A co-runner: this process's copy of the module, forward and backward until ``stop``, on ``cores``."""
    try:
        if cores is not None:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(1)
        params = [p for p in module.parameters() if p.requires_grad]
        started.wait(timeout=_CO_RUNNER_START_S)
        while not stop.is_set():
            targets = [t for t in tensor_leaves(module(*inputs)) if t.requires_grad and t.is_floating_point()]
            if targets and params:
                torch.autograd.grad(targets, params, [torch.ones_like(t) for t in targets], allow_unused=True)
    finally:
        os._exit(0)  # a fork of the profiler: nothing of the parent's to clean up


@dataclass(frozen=True)
class WholeSplit:
    """A split backward of the graph after its first node ``cut`` (whose output a later stage would receive):
    its I's and its W's milliseconds."""

    cut: str
    input_ms: float
    weight_ms: float


def in_context(alone: dict[str, NodeTiming], whole_fwd_ms: float, whole_bwd_ms: float,
               whole_split: WholeSplit | None = None) -> dict[str, NodeTiming]:
    """Node times measured alone, scaled so that they sum to the whole graph's measured forward and
    backward (each node keeps its share of each). A split backward's halves scale as the backward; given the
    graph's own split backward after its first node, its halves are scaled apart to sum to it as a stage's
    I and W compute them (in ``alone``'s order, the nodes after ``whole_split.cut``): I their input halves
    beside the whole backwards of the nodes without a split (the loss's among them); W runs one backward
    per weight group, each paying a fixed cost its node's weight half alone does not show (a GPT block's six
    groups took 0.1-0.16 ms each on one CPU thread), so each split node's W is its weight half in context
    as the backward plus an equal share of what the whole split's W takes beyond them (scaled alone where it
    takes less): a head stage's W, one large node, measured 1.65-1.92 ms; its weight half times the whole split's
    W over all weight halves (2.1x) predicted 2.78 ms, this way 1.66 ms.

    >>> scaled = in_context({"a": NodeTiming(1.0, 2.0), "b": NodeTiming(3.0, 0.0)}, 8.0, 1.0)
    >>> scaled["a"].fwd_ms, scaled["b"].fwd_ms, scaled["a"].bwd_ms, scaled["b"].bwd_ms
    (2.0, 6.0, 1.0, 0.0)
    """
    fwd_total = sum(t.fwd_ms for t in alone.values())
    bwd_total = sum(t.bwd_ms for t in alone.values())
    fwd_scale = whole_fwd_ms / fwd_total if fwd_total > 0 else 1.0
    bwd_scale = whole_bwd_ms / bwd_total if bwd_total > 0 and whole_bwd_ms > 0 else 1.0
    input_scale = weight_scale = bwd_scale
    group_ms = 0.0  # each weight group's own backward call in W, beyond its node's weight half
    if whole_split is not None and whole_split.cut in alone:
        names = list(alone)
        after = [alone[name] for name in names[names.index(whole_split.cut) + 1:]]
        split = [t.split_ms for t in after if t.split_ms is not None]
        whole = sum(t.bwd_ms for t in after if t.split_ms is None) * bwd_scale  # no weights, or unreachable ones
        input_total, weight_total = sum(i for i, _ in split), sum(w for _, w in split)
        if input_total > 0 and whole_split.input_ms > whole:
            input_scale = (whole_split.input_ms - whole) / input_total
        if split and whole_split.weight_ms > weight_total * bwd_scale:
            group_ms = (whole_split.weight_ms - weight_total * bwd_scale) / len(split)
        elif weight_total > 0:
            weight_scale = whole_split.weight_ms / weight_total
    return {name: dataclasses.replace(t, fwd_ms=t.fwd_ms * fwd_scale, bwd_ms=t.bwd_ms * bwd_scale,
                                      split_ms=None if t.split_ms is None else (
                                          t.split_ms[0] * input_scale, t.split_ms[1] * weight_scale + group_ms))
            for name, t in alone.items()}


def _pooled(samples: dict[str, _NodeSamples], signatures: Mapping[str, tuple | None]) -> dict[str, _NodeSamples]:
    """Each node's samples with those of every node of its signature (a model's repeated layers): a slow spell of
    the machine over one node's rounds is then outvoted by its copies' (a GPT-2's first attention's backward,
    timed while another process ran on its core, came out 40x its second's, and the stage cut after it)."""
    groups: dict[tuple, list[str]] = {}
    for name, signature in signatures.items():
        if signature is not None and name in samples:
            groups.setdefault(signature, []).append(name)
    pooled = dict(samples)
    for names in groups.values():
        for name in names if len(names) > 1 else ():
            pooled[name] = samples[name].pooled([samples[other] for other in names if other != name])
    return pooled


def _signature(node: torch.fx.Node, module: torch.fx.GraphModule, arguments: Any) -> tuple | None:
    """What a node's times depend on: what it calls (fake_memo.callee_key) and its arguments' shapes and
    dtypes; equal for the repeated layers of a model, None where that cannot be told (a user's module)."""
    callee = callee_key(node, module)
    if callee is None:
        return None
    leaves, spec = pytree.tree_flatten(arguments)
    return (callee, str(spec), tuple((tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor)
                                     else repr(x) for x in leaves))


def _real_callable(node: torch.fx.Node, module: torch.fx.GraphModule) -> tuple[Callable[..., Any], list]:
    if node.op == "call_module":
        submodule = module.get_submodule(node.target)
        return submodule, [p for p in submodule.parameters() if p.requires_grad]
    if node.op == "call_method":
        return (lambda self_arg, *args, **kwargs: getattr(self_arg, node.target)(*args, **kwargs)), []
    return node.target, []


def _isolate(args: Any, kwargs: Any) -> tuple[Any, Any, list[torch.Tensor]]:
    """Fresh leaves for activation inputs that need grad; clones so in-place ops stay legal."""
    leaves: list[torch.Tensor] = []

    def isolate(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.requires_grad:
            return value
        if isinstance(value, nn.Parameter):
            leaves.append(value)
            return value
        leaf = value.detach().requires_grad_(True)
        leaves.append(leaf)
        return leaf.clone()
    return pytree.tree_map(isolate, args), pytree.tree_map(isolate, kwargs), leaves


def _cache_path(cache_dir: str | Path | None, fingerprint: str, device: str, dtype: str,
                co_runners: int = 0) -> Path | None:
    if cache_dir is None:
        return None
    safe_device = "".join(c if c.isalnum() or c in "-_." else "_" for c in device)
    threads = torch.get_num_threads()  # times depend on the intra-op threads they were measured with
    beside = f"-x{co_runners + 1}" if co_runners else ""  # and on how many copies ran at once
    return Path(cache_dir).expanduser() / f"{fingerprint[:24]}-{safe_device}-{dtype}-t{threads}{beside}.json"


def _read_cache(path: Path, fingerprint: str) -> dict[str, NodeTiming] | None:
    """Timings from a cache file, or None if it is missing, stale or unreadable (then re-measure)."""
    try:
        data = json.loads(path.read_text())
        if data["version"] != _CACHE_VERSION or data["fingerprint"] != fingerprint:
            return None
        return {name: NodeTiming(**{**row, "split_ms": tuple(row["split_ms"]) if row.get("split_ms") else None})
                for name, row in data["nodes"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(path: Path, fingerprint: str, device: str, dtype: str,
                 timings: dict[str, NodeTiming]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"version": _CACHE_VERSION, "fingerprint": fingerprint, "device": device, "dtype": dtype,
            "nodes": {name: dataclasses.asdict(t) for name, t in timings.items()}}
    handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        json.dump(data, out, indent=1, sort_keys=True)
    os.replace(tmp, path)
