"""`tessera plan`, `tessera show` and `tessera simulate`: plans from the command line."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from cost_models.errors import InvalidArgument
from planner.budget import DEFAULT_RESERVE
from planner.cli.progress_line import ProgressLine


@dataclass(frozen=True)
class PlanRequest:
    """Everything `tessera plan` was asked for."""

    model: str
    model_args: tuple[str, ...]
    inputs: tuple[str, ...]
    batch_size: int
    gpus: int
    mem: str  # with a unit: "16GB"
    reserve: str = DEFAULT_RESERVE
    device: str = "V100-16GB"
    gpus_per_node: int | None = None
    optimizer: str = "adam"
    precision: str | None = None  # None: the model's own (its weights' dtype)
    schedules: tuple[str, ...] | None = ("gpipe", "1f1b")  # None: every synchronous family
    allow_stale_weights: bool = False  # also consider wpipe (its first group trains on stale weights)
    micro_batch_sizes: tuple[int, ...] | None = None
    num_stages: tuple[int, ...] | None = None
    data_parallel: tuple[int, ...] | None = None
    time_limit_s: float = 60.0
    leaf_modules: tuple[str, ...] = ()
    output: Path | None = None
    offload: bool | tuple[str, ...] = True  # decide recompute, swap and where model state lives (or only these)
    host_mem: str | None = None  # per node, with a unit (None: the device preset's node)
    nvme: str | None = None
    spatial: bool = True  # may the first stage run on image tiles
    profile: bool | None = None  # measure node times (real weights): None on the "cpu" device only, True also
    # on a GPU this machine has, False never


def run_plan(request: PlanRequest, search_root: Path | None = None,
             progress: ProgressLine | None = None) -> str:
    """Build the model (on the meta device; on the CPU with real weights to measure it for the "cpu"
    device, or with --profile for a GPU this machine has), plan it, save the plan if asked; returns the
    printout."""
    try:
        return _plan_and_save(request, search_root, progress)
    finally:
        if progress is not None:
            progress.close()


def _plan_and_save(request: PlanRequest, search_root: Path | None, progress: ProgressLine | None) -> str:
    from cost_models.cpu_device import CPU_NAME
    from cost_models.devices import get_device
    from cost_models.graph.model_spec import (
        build_model,
        example_inputs,
        load_builder,
        parse_input,
        parse_model_args,
    )
    from cost_models.units import parse_mem_bytes
    from planner.api import check_measurable, plan
    from planner.budget import parse_reserve

    specs = [parse_input(text) for text in request.inputs]
    kwargs = parse_model_args(request.model_args)
    mem_bytes = parse_mem_bytes(request.mem, unit_required=True)
    reserve = parse_reserve(request.reserve, unit_required=True)
    if request.output is not None and not request.output.parent.resolve().is_dir():
        raise InvalidArgument(f"cannot write the plan to {str(request.output)!r}: folder "
                              f"{str(request.output.parent)!r} does not exist")
    if request.output is not None and request.output.is_dir():
        raise InvalidArgument(f"cannot write the plan to {str(request.output)!r}: it is a folder; give a file "
                              f"name, e.g. -o {request.output / 'plan.json'}")
    if request.output is not None and not os.access(request.output.parent.resolve(), os.W_OK):
        raise InvalidArgument(f"cannot write the plan to {str(request.output)!r}: folder "
                              f"{str(request.output.parent)!r} is not writable; give another -o")
    builder = load_builder(request.model, search_root)
    device = get_device(request.device)
    measured = device.name == CPU_NAME if request.profile is None else request.profile
    if measured:
        check_measurable(device)  # before the model is built with real weights
    model = build_model(builder, kwargs, "cpu" if measured else "meta")
    result = plan(model, request.gpus, mem_bytes, reserve=reserve, batch_size=request.batch_size,
                  example_inputs=example_inputs(specs, 1, "meta"), device=request.device,
                  gpus_per_node=request.gpus_per_node, optimizer=request.optimizer,
                  precision=request.precision, schedules=request.schedules,
                  allow_stale_weights=request.allow_stale_weights,
                  micro_batch_sizes=request.micro_batch_sizes, time_limit_s=request.time_limit_s,
                  num_stages=request.num_stages, data_parallel=request.data_parallel,
                  builder=request.model, builder_kwargs=kwargs, leaf_modules=request.leaf_modules,
                  progress=progress, offload=request.offload,
                  host_mem=None if request.host_mem is None else parse_mem_bytes(request.host_mem, unit_required=True),
                  nvme=None if request.nvme is None else parse_mem_bytes(request.nvme, unit_required=True),
                  spatial=request.spatial, profile=measured)
    if request.output is not None:
        result.save(request.output)
    return str(result) + (f"\nplan written to {request.output}" if request.output else "")


def run_show(path: Path) -> str:
    from planner.plan.document import Plan

    return str(Plan.load(path))


def run_simulate(path: Path, trace_path: Path | None, svg_path: Path | None) -> str:
    """Replay the plan's programs; write a Chrome trace (Perfetto) and an SVG timeline."""
    from cost_models.units import format_bytes, format_ms
    from planner.plan.document import Plan
    from planner.plan.text import idle_label
    from planner.schedules.timeline import chrome_trace, svg
    from planner.simulation import rank_names, simulate_plan

    plan = Plan.load(path)
    result = simulate_plan(plan)
    trace_path = trace_path or path.with_suffix(".trace.json")
    svg_path = svg_path or path.with_suffix(".svg")
    names = rank_names(plan.layout)
    trace_path.write_text(json.dumps(chrome_trace(result, rank_names=names)))
    svg_path.write_text(svg(result, rank_names=names))
    peaks = "; ".join(f"ranks {first}-{last}: {format_bytes(nbytes)}" if first != last else
                      f"rank {first}: {format_bytes(nbytes)}" for first, last, nbytes in _runs(result.peak_mem_bytes))
    return (f"simulated step {format_ms(result.step_ms)} (plan predicted "
            f"{format_ms(plan.predicted.step_ms)}, ILP objective {format_ms(plan.solver.objective)}), "
            f"{idle_label(plan.num_stages)} {result.bubble_fraction:.1%}\npeak memory: {peaks}\n"
            f"timeline: {trace_path} (open in https://ui.perfetto.dev) and {svg_path}")


def _runs(values: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first rank, last rank, value) for each run of equal consecutive values."""
    runs: list[tuple[int, int, int]] = []
    for rank, value in enumerate(values):
        if runs and runs[-1][2] == value and runs[-1][1] == rank - 1:
            runs[-1] = (runs[-1][0], rank, value)
        else:
            runs.append((rank, rank, value))
    return runs
