"""plan(): validate the request, trace, search, and assemble the Plan (planner/assemble.py)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cost_models.cpu_device import CPU_NAME, usable_cores
from cost_models.devices import DeviceSpec, get_device
from cost_models.errors import InvalidArgument, TesseraWarning
from cost_models.estimation import CostTable, model_precision
from cost_models.graph.ir import LayerGraph
from cost_models.graph.model_spec import builder_forms
from cost_models.graph.tracing import normalise_inputs, trace
from cost_models.memory import Optimizer, Precision, get_optimizer, get_precision
from cost_models.profiling import in_compute_dtype, local_gpu, measured_table
from cost_models.units import format_bytes, parse_mem_bytes
from planner.assemble import build_plan
from planner.budget import DEFAULT_RESERVE, Reserve, parse_reserve, usable_bytes
from planner.plan import InputMeta, ModelRef, Plan, ScheduleKind, freeze
from planner.progress import Phase, Progress, ProgressEvent
from planner.search.configs import SearchSpace, divisors
from planner.search.problem import Offload
from planner.search.search import Search


def plan(model: nn.Module, gpus: int, mem: str | int, *, batch_size: int,
         example_inputs: torch.Tensor | Sequence[torch.Tensor], device: str | DeviceSpec = "V100-16GB",
         gpus_per_node: int | None = None, optimizer: str | Optimizer = "adam",
         precision: str | Precision | None = None,
         schedules: Sequence[str | ScheduleKind] | None = None, allow_stale_weights: bool = False,
         micro_batch_sizes: Sequence[int] | None = None,
         num_stages: Sequence[int] | None = None, time_limit_s: float = 60.0, builder: str | None = None,
         builder_kwargs: Mapping[str, Any] | None = None, leaf_modules: Sequence[type | str] = (),
         graph: LayerGraph | None = None, reserve: str | int | Reserve = DEFAULT_RESERVE,
         progress: Progress | None = None, data_parallel: Sequence[int] | None = None,
         offload: bool | Sequence[str] = True, host_mem: str | int | None = None,
         nvme: str | int | None = None, spatial: bool = True, profile: bool | None = None) -> Plan:
    """Choose the fastest pipeline x data-parallel plan of ``model`` that fits ``mem`` per GPU.

    ``batch_size`` is the global batch per step; ``example_inputs`` only fix shapes (any batch
    dimension; meta tensors are fine). Costs are roofline estimates on ``device``. ``precision``
    defaults to the model's own (the dtype of its weights: a float64 model is costed at 8 bytes).
    ``micro_batch_sizes``, ``num_stages`` and ``data_parallel`` restrict the search (default: every
    divisor); ``schedules`` the schedule families (default: every synchronous one). WPipe ("wpipe"),
    whose first half of the parts trains on weights one update old, is considered only with
    ``allow_stale_weights=True``, which changes the training semantics. A plan uses all ``gpus``
    unless the batch is smaller than ``gpus`` (then at most ``batch_size`` GPUs can work at once, and
    a plan on fewer GPUs wins when it is as fast) or ``num_stages`` x ``data_parallel`` asks for fewer;
    ``plan.cluster.gpus`` is the number it uses.
    ``mem`` is each GPU's memory ("16GB" or bytes); ``reserve`` ("5%" of it by default, or a size)
    is kept free for the CUDA context and fragmentation, and plans fit what is left. A budget
    above the device's memory is planned for, with a TesseraWarning. ``progress``, if given,
    receives a ProgressEvent per phase and per configuration solved (planner/progress.py).

    Memory decisions are made in the same optimisation as the split: per unit of nodes, keep its
    saved activations, recompute them or swap them to the host; per stage, its model state
    sharded over its data-parallel copies (ZeRO-1, or ZeRO-3: weights and gradients too, gathered layer by layer)
    or not, and its optimizer state on the GPU, the
    host or NVMe (the step then runs on the host, and each backward's gradients may go there as they are
    made: ZeRO-Offload). ``host_mem`` and ``nvme`` are each node's host memory and NVMe capacity (default:
    the device preset's node); ``offload=False`` keeps everything on the GPU, and a list of "recompute",
    "swap", "zero", "host", "nvme", "grads", "params" allows only those ("grads" with "host" or "nvme"; "params", the
    weights' ZeRO-3 shards on the host, with "zero" and "host" or "nvme").

    On ``device="cpu"`` a model whose weights are on the CPU is costed from per-node times measured on
    this machine at each micro-batch size the search tries (cached under ~/.cache/tessera/profiles, or
    $TESSERA_CACHE_DIR),
    not the roofline; ``profile=False`` estimates instead, ``profile=True`` insists on measuring.

    An image model's first stage may run on P image tiles (P ranks per replica, halos exchanged
    between them, joined before the next stage), cut square or in strips: chosen where it is
    faster or the only way to fit; ``spatial=False`` never tiles.

    Example::

        p = plan(resnet50(), gpus=16, mem="16GB", batch_size=256,
                 example_inputs=torch.empty(1, 3, 224, 224, device="meta"))
        print(p); p.save("plan.json")
    """
    inputs = normalise_inputs(example_inputs)
    mode = None if precision is None else get_precision(precision)
    space, spec = validate_space(gpus, mem, batch_size, device, gpus_per_node, optimizer,
                                 mode or Precision.FP32, schedules, micro_batch_sizes, time_limit_s, num_stages,
                                 reserve, data_parallel=data_parallel, offload=offload, host_mem=host_mem,
                                 nvme=nvme, spatial=spatial, allow_stale_weights=allow_stale_weights)
    warn_about_budget(space, spec)
    report = progress or (lambda event: None)
    if graph is None:
        report(ProgressEvent(Phase.TRACING, detail=type(model).__name__))
        graph = trace(model, inputs, leaf_modules=leaf_modules)
    space = dataclasses.replace(space, precision=mode or model_precision(graph))
    measure = node_measure(model, graph, inputs, space, spec, leaf_modules) if measures(model, spec, profile) else None
    result = Search(graph, spec, space, progress, measure).run()
    report(ProgressEvent(Phase.ASSEMBLING, detail="lowering, validating and simulating the winner"))
    made = build_plan(graph, spec, space, result,
                      model_ref(graph, inputs, space, builder, builder_kwargs, leaf_modules))
    warn_shared_cores(made)
    return made


def measures(model: nn.Module, device: DeviceSpec, profile: bool | None) -> bool:
    """Whether plan() costs from node times measured on this machine: by default for the "cpu" device and a
    model whose weights are on the CPU; with ``profile=True`` also for a GPU this machine has
    (cost_models.profiling.local_gpu: the device's preset, or a `tessera calibrate` file of it), where
    the whole model is timed on that one GPU at each micro-batch size (so only when asked: a model
    planned over many GPUs rarely fits one)."""
    weights = {p.device.type for p in model.parameters()}
    on_cpu = device.name == CPU_NAME
    usable = weights == {"cpu"} if on_cpu else bool(weights) and "meta" not in weights
    if not profile:
        return profile is None and on_cpu and usable
    check_measurable(device)
    if not usable:
        raise InvalidArgument(f"profile=True needs the model's weights {'on the CPU' if on_cpu else '(not meta)'} "
                              f"to time its nodes; build it with device='cpu' (not meta), or plan with "
                              f"profile=False (roofline costs)")
    return True


def check_measurable(device: DeviceSpec) -> None:
    """Refuse, in one line, to measure node times for a GPU this machine does not have."""
    if device.name != CPU_NAME and local_gpu(device) is None:
        raise InvalidArgument(f"measuring node times (profile=True, --profile) needs the GPU on this machine, "
                              f"but it has no {device.name!r}; run it where that GPU is (e.g. with the device file "
                              f"`tessera calibrate --device cuda` wrote), or plan with profile=False (roofline costs)")


def node_measure(model: nn.Module, graph: LayerGraph, inputs: tuple[torch.Tensor, ...], space: SearchSpace,
                 device: DeviceSpec, leaf_modules: Sequence[type | str] = ()) -> Callable[[int], CostTable]:
    """The graph's costs at a micro-batch size with node times measured here (measured_table), the model
    traced with the ``leaf_modules`` it was planned with.

    The model is timed in the dtype the runtime computes in (a 16-bit plan: a 16-bit copy; one copy for
    every micro-batch size). On the CPU, copies train on the other cores while the graph is timed, as the
    node's other ranks will: as many as run at once, a core each. On a GPU, on the device this machine has."""
    dtype = getattr(torch, space.precision.dtype)
    if device.name == CPU_NAME:
        ranks = min(space.gpus_per_node, space.gpus, usable_cores())
        return functools.partial(measured_table, in_compute_dtype(model, torch.device("cpu"), dtype), graph, inputs,
                                 optimizer=space.optimizer.value, precision=space.precision.value,
                                 co_runners=ranks - 1, leaf_modules=leaf_modules)
    gpu = local_gpu(device)
    assert gpu is not None, "measures() said this machine has the device"
    return functools.partial(measured_table, in_compute_dtype(model, gpu, dtype), graph, inputs,
                             optimizer=space.optimizer.value, precision=space.precision.value, device=device,
                             leaf_modules=leaf_modules)


def model_ref(graph: LayerGraph, inputs: tuple[torch.Tensor, ...], space: SearchSpace,
              builder: str | None, builder_kwargs: Mapping[str, Any] | None,
              leaf_modules: Sequence[type | str] = ()) -> ModelRef:
    """A relative model file (``path/file.py:builder``) is stored absolute, and as given (relative to
    the current directory) for a copy of the project elsewhere; leaf modules by name (a class by its name),
    so the runtime traces the model as it was planned."""
    absolute, relative = builder_forms(builder, Path.cwd()) if builder else (None, None)
    leaves = tuple(dict.fromkeys(spec if isinstance(spec, str) else spec.__name__ for spec in leaf_modules))
    return ModelRef(absolute, freeze(dict(builder_kwargs or {})), graph.fingerprint,
                    tuple(InputMeta(tuple(x.shape), str(x.dtype).removeprefix("torch."))
                          for x in inputs), space.precision, relative, leaves)


def validate_space(gpus: int, mem: str | int, batch_size: int, device: str | DeviceSpec,
                   gpus_per_node: int | None, optimizer: str | Optimizer, precision: str | Precision,
                   schedules: Sequence[str | ScheduleKind] | None, micro_batch_sizes: Sequence[int] | None,
                   time_limit_s: float, num_stages: Sequence[int] | None = None,
                   reserve: str | int | Reserve = DEFAULT_RESERVE, *,
                   data_parallel: Sequence[int] | None = None, offload: bool | Sequence[str] = True,
                   host_mem: str | int | None = None, nvme: str | int | None = None,
                   spatial: bool = True, allow_stale_weights: bool = False) -> tuple[SearchSpace, DeviceSpec]:
    """Validate every argument before any tracing, with messages that name the value and fix."""
    _check_whole("gpus", gpus)
    _check_whole("batch_size", batch_size)
    per_node = min(gpus, 8) if gpus_per_node is None else gpus_per_node
    _check_whole("gpus_per_node", per_node)
    searched = _schedules(schedules, allow_stale_weights)
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not (
            0 < time_limit_s < float("inf")):
        raise InvalidArgument(f"the time limit must be a number of seconds > 0, got {time_limit_s!r}; "
                              f"give e.g. --time-limit 60 (plan(time_limit_s=60))")
    for name, values in (("micro_batch_sizes", micro_batch_sizes), ("num_stages", num_stages),
                         ("data_parallel", data_parallel)):
        if values is not None and not isinstance(values, Sequence):
            raise InvalidArgument(f"{name} is the list of values to search, got {values!r}; give e.g. "
                                  f"{name}=[{values!r}]")
    if micro_batch_sizes is not None and (not micro_batch_sizes or min(micro_batch_sizes) < 1):
        raise InvalidArgument(f"micro_batch_sizes must be positive, got {list(micro_batch_sizes)}")
    if not (spatial and num_stages and all(1 <= v <= gpus for v in num_stages)):
        _check_divisors("num_stages", num_stages, gpus)  # with stage 0 on P tiles, S need not divide the GPUs
    _check_divisors("data_parallel", data_parallel, gpus)
    spec = get_device(device)
    # text needs its unit, as on the command line ("16" is far more likely a slip than 16 bytes); an int is bytes
    mem_bytes, kept = parse_mem_bytes(mem, unit_required=True), parse_reserve(reserve)
    usable = usable_bytes(mem_bytes, kept)
    host_mem_bytes = None if host_mem is None else parse_mem_bytes(host_mem, unit_required=True)
    nvme_bytes = None if nvme is None else parse_mem_bytes(nvme, unit_required=True)
    if spec.name == CPU_NAME:  # one memory and one disk: the ranks' budgets and the host tier share the machine's
        if host_mem_bytes is None:
            host_mem_bytes = max(0, spec.host_mem_bytes - per_node * mem_bytes)
        nvme_bytes = spec.nvme_bytes if nvme_bytes is None else nvme_bytes
    space = SearchSpace(gpus, per_node, usable, batch_size, get_optimizer(optimizer),
                        get_precision(precision), searched,
                        tuple(micro_batch_sizes) if micro_batch_sizes else None,
                        tuple(num_stages) if num_stages else None, time_limit_s=time_limit_s,
                        reserve=kept, reserve_bytes=mem_bytes - usable,
                        data_parallel=tuple(data_parallel) if data_parallel else None,
                        offload=Offload.parse(offload),
                        host_mem_bytes=host_mem_bytes, nvme_bytes=nvme_bytes, spatial=spatial)
    return space, spec


def _schedules(schedules: Sequence[str | ScheduleKind] | None, allow_stale_weights: bool) -> tuple[ScheduleKind, ...]:
    """The families to search: those given (default every synchronous one, and WPipe if stale weights are
    allowed); a family that trains on stale weights only with ``allow_stale_weights``."""
    if schedules is None:
        return tuple(kind for kind in ScheduleKind if allow_stale_weights or not kind.stale_weights)
    known = {kind.value for kind in ScheduleKind}
    unknown = [s for s in schedules if s not in known]
    if unknown or not schedules:
        raise InvalidArgument(f"schedules {list(unknown or schedules)} not supported; choose from "
                              f"{', '.join(sorted(known))}")
    searched = tuple(dict.fromkeys(ScheduleKind(s) for s in schedules))
    stale = [kind.value for kind in searched if kind.stale_weights]
    if stale and not allow_stale_weights:
        synchronous = ", ".join(kind.value for kind in ScheduleKind if not kind.stale_weights)
        raise InvalidArgument(f"schedule {stale[0]!r} trains the first half of the model's parts on weights one "
                              f"update old (a different training rule); allow it with allow_stale_weights=True "
                              f"(--allow-stale-weights), or choose a synchronous schedule: {synchronous}")
    return searched


def _check_whole(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{name} must be a whole number >= 1, got {value!r}")


def _check_divisors(name: str, values: Sequence[int] | None, gpus: int) -> None:
    if values is not None and (not values or any(v < 1 or gpus % v for v in values)):
        raise InvalidArgument(f"{name} {list(values or [])} must divide gpus={gpus}; "
                              f"choose from {divisors(gpus)}")


def warn_about_budget(space: SearchSpace, device: DeviceSpec) -> None:
    mem_bytes = space.mem_bytes + space.reserve_bytes
    if mem_bytes > device.mem_bytes:
        warnings.warn(TesseraWarning(
            f"the budget {format_bytes(mem_bytes)} per GPU exceeds the {device.name}'s "
            f"{format_bytes(device.mem_bytes)}; planning for it anyway (is --mem right?)"), stacklevel=3)
    ranks_bytes = space.gpus_per_node * mem_bytes
    if device.name == CPU_NAME and space.gpus_per_node > 1 and ranks_bytes > device.mem_bytes:
        warnings.warn(TesseraWarning(
            f"{space.gpus_per_node} CPU ranks of {format_bytes(mem_bytes)} each need {format_bytes(ranks_bytes)}, "
            f"more than this machine's {format_bytes(device.mem_bytes)} they share; planning for it anyway "
            f"(give mem, --mem, at most {format_bytes(device.mem_bytes // space.gpus_per_node)})"), stacklevel=3)


def warn_shared_cores(made: Plan) -> None:
    """A cpu plan whose ranks on a node outnumber this machine's cores (those it uses: a batch smaller than the
    GPUs given uses fewer)."""
    cores, ranks = usable_cores(), min(made.cluster.gpus, made.cluster.gpus_per_node)
    if made.cluster.device_name == CPU_NAME and ranks > cores:
        warnings.warn(TesseraWarning(
            f"{ranks} CPU ranks per node on this machine's {cores} cores: the cpu device is "
            f"measured one rank per core, so a plan whose ranks share cores runs slower than predicted "
            f"(plan at most {cores} ranks per node, or for a machine with more cores)"), stacklevel=3)
