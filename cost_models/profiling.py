"""profile(): measure real per-node forward/backward times (and CUDA memory), cached as JSON."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import operator
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from cost_models.allocations import peaks_within
from cost_models.device_spec import CALIBRATED
from cost_models.devices import DeviceSpec, cache_root, get_device
from cost_models.errors import ProfileError
from cost_models.estimation import CostTable, estimate
from cost_models.fake_measure import detach_tree
from cost_models.fake_memo import callee_key
from cost_models.graph.shapes import tensor_leaves
from cost_models.loss import training_loss

if TYPE_CHECKING:
    from cost_models.graph.ir import LayerGraph

_CACHE_VERSION = 6  # 2: node times scaled to the whole graph's measured pass; 3: from a cold cache; 4: the loss;
# 5: split backwards; 6: what each backward allocates
_EVICT_BYTES = 64 * 2**20  # written before a pass timed from a cold cache: more than a CPU's last-level cache
_BACKWARD_LABEL = "tessera.backward:"  # the profiler range of each node's backward whose allocations are measured
_CO_RUNNER_START_S = 60.0  # for the co-running copies to start (they fork from this process) and to stop


@dataclass(frozen=True)
class NodeTiming:
    """Median forward and backward milliseconds of one node, its CUDA forward peak, the most its backward
    allocates (its inputs' and weights' gradients, the kernel's workspace: oneDNN's convolution takes
    two more inputs' worth), and for a node with both weights and inputs that carry a gradient, its
    backward split in two as ZB-H1 runs it: I (the inputs' gradients) then W (the weights', from a cold
    cache: W runs later, after other work)."""

    fwd_ms: float
    bwd_ms: float
    fwd_peak_bytes: int | None = None
    split_ms: tuple[float, float] | None = None
    bwd_bytes: int | None = None


def profile(model: nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor],
            device: str = "cpu", *, optimizer: str = "adam", precision: str | None = None,
            warmup: int = 2, repeats: int = 5, cache_dir: str | Path | None = None,
            refresh: bool = False, leaf_modules: Sequence[type | str] = (), co_runners: int = 0) -> CostTable:
    """Cost table of ``model`` with forward/backward times measured node by node.

    ``device`` is where to measure: ``"cpu"``, ``"cuda"``/``"cuda:N"``, or a GPU preset name
    (measured on the local GPU, labelled with the preset). The model and inputs must already
    live there. Each node runs ``warmup`` + ``repeats`` times on its real inputs; the median is
    kept. A node timed alone misses what it costs inside the whole pass (caches, the autograd
    engine's work between nodes, on CUDA the launch queue instead of a synchronisation per node), so
    the whole graph's forward and backward are timed too and each node's times are scaled so that
    they sum to them: the node keeps its share, the total is what a stage really runs. On the CPU the whole
    graph is timed while ``co_runners`` copies of it train on other cores (:func:`co_running`), as the
    other ranks of a node do: they share its memory bandwidth and last-level cache. The output node
    gets the training loss's times (cost_models/loss.py), which the last stage runs after the model. With
    ``cache_dir`` the timings are stored as JSON keyed by graph fingerprint, device
    and dtype, and reused unless ``refresh``. Memory columns come from the fake-tensor
    measurement; on CUDA each node's measured forward peak is recorded too.

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
                       ) -> tuple["LayerGraph", CostTable]:
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


def measured_table(model: nn.Module, graph: "LayerGraph", example_inputs: Sequence[torch.Tensor],
                   batch_size: int, *, optimizer: str, precision: str, co_runners: int = 0,
                   cache_dir: str | Path | None = None, device: DeviceSpec | None = None) -> CostTable:
    """``graph``'s costs at micro-batch ``batch_size`` (estimate()) with every node's forward and backward
    time measured where ``model`` is, at that batch (profile(), cached): what plan() costs a measured plan with.

    ``example_inputs`` give each input's sample shape and dtype (any device; meta is fine): the profile
    runs on random floats (in the model's dtype) and zero integers (token ids) of that batch. On the CPU
    it runs on one intra-op thread as the runtime's CPU ranks compute (torchrun gives each one), beside
    ``co_runners`` copies training on other cores (the node's other ranks: profile()); the model is
    already in the dtype the runtime computes in (:func:`in_compute_dtype`). ``device`` is
    the spec the rest of the table is costed for (memory, transfers; default: the measured device's).
    ``cache_dir`` defaults to the ``profiles`` folder of :func:`cost_models.devices.cache_root`."""
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
    try:
        _, measured = profile_with_graph(model, inputs, "cpu" if where.type == "cpu" else str(where),
                                         optimizer=optimizer, precision=precision,
                                         cache_dir=cache_dir or cache_root() / "profiles", co_runners=co_runners)
    except torch.cuda.OutOfMemoryError as error:
        raise ProfileError(f"timing the whole model at micro-batch {batch_size} ran out of {where}'s memory; "
                           f"plan with profile=False (--no-profile: roofline costs), or with smaller "
                           f"micro_batch_sizes (--micro-batch-size)") from error
    finally:
        torch.set_num_threads(threads)
    times = {cost.name: cost for cost in measured.costs}
    table = estimate(graph, device or measured.device, optimizer, precision, batch_size=batch_size)
    unmatched = [cost.name for cost in table.costs if cost.name not in times]
    if unmatched:
        raise ProfileError(f"the profiled graph at batch {batch_size} has no node {unmatched[0]!r} of the "
                           f"planned graph ({len(unmatched)} missing); plan with profile=False (roofline costs)")
    return dataclasses.replace(table, costs=tuple(
        dataclasses.replace(cost, fwd_ms=times[cost.name].fwd_ms, bwd_ms=times[cost.name].bwd_ms,
                            split_ms=times[cost.name].split_ms, measured_bwd_bytes=times[cost.name].measured_bwd_bytes)
        for cost in table.costs), source="measured")


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
    """Times each node in isolation on its real inputs, then scales the times to the whole graph's."""

    def __init__(self, module: torch.fx.GraphModule, device: torch.device, warmup: int,
                 repeats: int, co_runners: int = 0) -> None:
        self.module = module
        self.device = device
        self.warmup = warmup
        self.repeats = repeats
        self.co_runners = co_runners
        self._splits: dict[tuple, tuple[float, float]] = {}  # by _signature: repeated layers timed once
        self._evict = torch.empty(_EVICT_BYTES // 4) if device.type == "cpu" else None  # written to cool the cache

    def run(self, inputs: tuple[torch.Tensor, ...]) -> dict[str, NodeTiming]:
        buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        try:
            alone = self._run(inputs)
            # (CUDA's allocator gave each its peak as it was timed; a caller's own profiler session, which a
            # second would end, leaves the backwards' bytes estimated)
            if self.device.type == "cpu" and not torch.autograd.profiler._is_profiler_enabled:
                allocated = self._cpu_backward_bytes(inputs)
                alone = {name: dataclasses.replace(t, bwd_bytes=allocated.get(name)) for name, t in alone.items()}
            with co_running(self.module, inputs, self.co_runners):
                whole_fwd_ms, whole_bwd_ms = self._whole_graph_ms(inputs)
            timings = in_context(alone, whole_fwd_ms, whole_bwd_ms)
            loss = self._loss_timing(inputs)
            if loss is not None:
                timings[next(n.name for n in self.module.graph.nodes if n.op == "output")] = loss
            return timings
        finally:
            with torch.no_grad():
                for name, b in self.module.named_buffers():
                    b.copy_(buffers[name])

    def _run(self, inputs: tuple[torch.Tensor, ...]) -> dict[str, NodeTiming]:
        timings: dict[str, NodeTiming] = {}

        def timed(node: torch.fx.Node, env: dict[str, Any]) -> Any:
            output, timings[node.name] = self._time_node(node, env)
            return output

        self._each_node(inputs, timed)
        return timings

    def _each_node(self, inputs: tuple[torch.Tensor, ...],
                   compute: Callable[[torch.fx.Node, dict[str, Any]], Any]) -> None:
        """Run the graph on ``inputs`` node by node: ``compute(node, env)`` returns each call's output from
        the values before it (``env``, by node name)."""
        env: dict[str, Any] = {}
        feed = iter(inputs)
        for node in self.module.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = next(feed)
            elif node.op == "get_attr":
                env[node.name] = operator.attrgetter(node.target)(self.module)
            elif node.op != "output":
                env[node.name] = compute(node, env)

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

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as run:
            self._each_node(inputs, backward_once)
        return peaks_within(run, _BACKWARD_LABEL)

    def _whole_graph_ms(self, inputs: tuple[torch.Tensor, ...]) -> tuple[float, float]:
        """Median milliseconds of the whole graph's forward and of its backward into the weights, each from
        a cold CPU cache (in a training step other micro-batches' work runs in between)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        evict = self._evict
        fwd_samples, bwd_samples = [], []
        for _ in range(self.warmup + self.repeats):
            if evict is not None:
                evict.fill_(1.0)
            elapsed, output, _ = self._timed(lambda: self.module(*inputs))
            fwd_samples.append(elapsed)
            targets = [t for t in tensor_leaves(output) if t.requires_grad and t.is_floating_point()]
            if targets and params:
                grads = [torch.ones_like(t) for t in targets]
                if evict is not None:
                    evict.fill_(1.0)
                bwd_samples.append(self._timed(lambda targets=targets, grads=grads: torch.autograd.grad(
                    targets, params, grads, allow_unused=True))[0])
        return (statistics.median(fwd_samples[self.warmup:]),
                statistics.median(bwd_samples[self.warmup:]) if bwd_samples else 0.0)

    def _loss_timing(self, inputs: tuple[torch.Tensor, ...]) -> NodeTiming | None:
        """The training loss after the model (cost_models/loss.py), forward and backward into the output,
        which the last stage runs per micro-batch; None when the model does not return one float tensor."""
        with torch.no_grad():
            output = self.module(*inputs)
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        output = output.detach().requires_grad_(True)
        loss_fn = training_loss(tuple(output.shape), output.dtype)
        target = loss_fn.example_target(output.device)
        fwd_samples, bwd_samples = [], []
        for _ in range(self.warmup + self.repeats):
            elapsed, loss, _ = self._timed(lambda: loss_fn(output, target))
            fwd_samples.append(elapsed)
            bwd_samples.append(self._timed(lambda loss=loss: torch.autograd.grad(loss, output))[0])
        return NodeTiming(statistics.median(fwd_samples[self.warmup:]), statistics.median(bwd_samples[self.warmup:]))

    def _time_node(self, node: torch.fx.Node, env: dict[str, Any]) -> tuple[Any, NodeTiming]:
        function, params = _real_callable(node, self.module)
        args = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        fwd_samples, peak_bytes = [], None
        for _ in range(self.warmup + self.repeats):
            call_args, call_kwargs, leaves = _isolate(args, kwargs)
            elapsed, output, peak_bytes = self._timed(lambda: function(*call_args, **call_kwargs))
            fwd_samples.append(elapsed)
        targets = [t for t in tensor_leaves(output) if t.requires_grad and t.is_floating_point()]
        wrt = leaves + params
        bwd_samples, split = [0.0], None
        bwd_bytes = None
        if targets and wrt:
            grads = [torch.ones_like(t) for t in targets]
            bwd_samples = []
            for _ in range(self.warmup + self.repeats):
                elapsed, _, bwd_bytes = self._timed(lambda: torch.autograd.grad(
                    targets, wrt, grads, retain_graph=True, allow_unused=True))
                bwd_samples.append(elapsed)
            inputs = [leaf for leaf in leaves if not isinstance(leaf, nn.Parameter)]
            weights = [leaf for leaf in leaves if isinstance(leaf, nn.Parameter)] + params  # a get_attr's too
            if inputs and weights:
                key = _signature(node, self.module, (args, kwargs))
                split = self._splits.get(key) if key is not None else None
                if split is None:
                    split = self._split_ms(targets, grads, inputs, weights)
                    if key is not None:
                        self._splits[key] = split
        timing = NodeTiming(statistics.median(fwd_samples[self.warmup:]),
                            statistics.median(bwd_samples[self.warmup:] or bwd_samples), peak_bytes, split, bwd_bytes)
        return detach_tree(output), timing

    def _split_ms(self, targets: list[torch.Tensor], grads: list[torch.Tensor], inputs: list[torch.Tensor],
                  weights: list[torch.Tensor]) -> tuple[float, float]:
        """Median milliseconds of I (into ``inputs``) and of W (into ``weights``), W from a cold CPU cache
        (one warm-up and at most three samples: a third of the backward's samples' cost, for a figure
        that only a split backward's schedules read)."""
        evict = self._evict
        input_samples, weight_samples = [], []
        warmup = min(self.warmup, 1)
        for _ in range(warmup + min(self.repeats, 3)):
            input_samples.append(self._timed(lambda: torch.autograd.grad(
                targets, inputs, grads, retain_graph=True, allow_unused=True))[0])
            if evict is not None:
                evict.fill_(1.0)
            weight_samples.append(self._timed(lambda: torch.autograd.grad(
                targets, weights, grads, retain_graph=True, allow_unused=True))[0])
        return statistics.median(input_samples[warmup:]), statistics.median(weight_samples[warmup:])

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
    """``copies`` forked processes, each bound to its own core other than this process's, training
    ``module`` on ``inputs`` (forward, backward into the weights) until the block ends; yields their pids.
    Where the machine has fewer cores than that, the copies share what there is (as the ranks would)."""
    if copies <= 0:
        yield []
        return
    context = multiprocessing.get_context("fork")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    mine = set(cores)
    if len(cores) > copies:
        mine = {cores[0]}
        os.sched_setaffinity(0, mine)
    stop, started = context.Event(), context.Barrier(copies + 1)
    runners = [context.Process(target=_train_until, args=(module, inputs, stop, started,
                                                          cores[1 + index] if len(cores) > copies else None),
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
                 core: int | None) -> None:
    """A co-runner: this process's copy of the module, forward and backward until ``stop``."""
    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
        params = [p for p in module.parameters() if p.requires_grad]
        started.wait(timeout=_CO_RUNNER_START_S)
        while not stop.is_set():
            targets = [t for t in tensor_leaves(module(*inputs)) if t.requires_grad and t.is_floating_point()]
            if targets and params:
                torch.autograd.grad(targets, params, [torch.ones_like(t) for t in targets], allow_unused=True)
    finally:
        os._exit(0)  # a fork of the profiler: nothing of the parent's to clean up


def in_context(alone: dict[str, NodeTiming], whole_fwd_ms: float, whole_bwd_ms: float) -> dict[str, NodeTiming]:
    """Node times measured alone, scaled so that they sum to the whole graph's measured forward and
    backward (each node keeps its share of each; a split backward's halves scale as the backward).

    >>> scaled = in_context({"a": NodeTiming(1.0, 2.0), "b": NodeTiming(3.0, 0.0)}, 8.0, 1.0)
    >>> scaled["a"].fwd_ms, scaled["b"].fwd_ms, scaled["a"].bwd_ms, scaled["b"].bwd_ms
    (2.0, 6.0, 1.0, 0.0)
    """
    fwd_total = sum(t.fwd_ms for t in alone.values())
    bwd_total = sum(t.bwd_ms for t in alone.values())
    fwd_scale = whole_fwd_ms / fwd_total if fwd_total > 0 else 1.0
    bwd_scale = whole_bwd_ms / bwd_total if bwd_total > 0 and whole_bwd_ms > 0 else 1.0
    return {name: dataclasses.replace(t, fwd_ms=t.fwd_ms * fwd_scale, bwd_ms=t.bwd_ms * bwd_scale,
                                      split_ms=None if t.split_ms is None else (t.split_ms[0] * bwd_scale,
                                                                                t.split_ms[1] * bwd_scale))
            for name, t in alone.items()}


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
