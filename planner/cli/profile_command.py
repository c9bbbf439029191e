"""`tessera profile`: build a model from its spec, cost or measure it, and render the table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cost_models.errors import InvalidArgument
from cost_models.graph.model_spec import (
    build_model,
    example_inputs,
    load_builder,
    parse_input,
    parse_model_args,
)


@dataclass(frozen=True)
class ProfileRequest:
    """Everything `tessera profile` was asked for; ``measure=None`` means "cpu measures"."""

    model: str
    model_args: tuple[str, ...]
    inputs: tuple[str, ...]
    batch_size: int
    device: str
    optimizer: str = "adam"
    precision: str | None = None  # None: the model's own (its weights' dtype)
    measure: bool | None = None
    repeats: int = 5
    cache_dir: Path | None = None
    leaf_modules: tuple[str, ...] = ()
    top: int | None = None
    output: Path | None = None


def run_profile(request: ProfileRequest, search_root: Path | None = None) -> str:
    """Validate everything first, then trace and cost; returns the rendered table."""
    from cost_models import estimate, get_device
    from cost_models.graph.tracing import trace_module
    from cost_models.memory import get_optimizer, get_precision
    from cost_models.profiling import profile_with_graph
    from planner.reports.cost_report import format_cost_table

    specs = [parse_input(text) for text in request.inputs]
    kwargs = parse_model_args(request.model_args)
    builder = load_builder(request.model, search_root)
    measure = request.device == "cpu" if request.measure is None else request.measure
    precision = get_precision(request.precision) if request.precision is not None else None
    get_optimizer(request.optimizer)
    if not measure:
        get_device(request.device)
    if request.repeats < 1:
        raise InvalidArgument(f"--repeats must be >= 1, got {request.repeats}")
    build_device = ("cpu" if request.device == "cpu" else "cuda") if measure else "meta"
    model = build_model(builder, kwargs, build_device)
    inputs = example_inputs(specs, request.batch_size, build_device)
    if measure:
        if precision is not None:
            dtype = getattr(torch, precision.dtype)
            model = model.to(dtype)
            inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
        graph, table = profile_with_graph(
            model, inputs, request.device, optimizer=request.optimizer, precision=request.precision,
            repeats=request.repeats, cache_dir=request.cache_dir, leaf_modules=request.leaf_modules)
    else:
        graph, _ = trace_module(model, inputs, request.leaf_modules)
        table = estimate(graph, request.device, request.optimizer, request.precision)
    if request.output is not None:
        table.save(request.output)
    return format_cost_table(graph, table, top=request.top)
