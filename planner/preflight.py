"""What can be checked of a saved plan before any process starts: its consistency and its model.

``check_plan`` refuses a plan whose schema, sizes, batch arithmetic or programs disagree (the
validator replays every rank's program against the layout, so a corrupt plan is refused instead
of hanging). ``rebuild_model`` and ``trace_checked`` rebuild the plan's model from its builder on
the meta device and check, by a shape-only pass on fake tensors (nothing is costed), that it is
the model that was planned. `tessera run` makes these checks before launching torchrun, and every
rank makes them again (runtime/setup.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.fx
from torch import nn

from cost_models.errors import PlanFileError, RuntimeSetupError
from cost_models.graph.capture import LeafSpec
from cost_models.units import plural
from cost_models.memory import Precision
from planner.plan import SCHEMA_VERSION, Plan, check_invariants
from planner.schedules import Program, ScheduleError, parse_programs, validate


def check_plan(plan: Plan) -> None:
    """Schema, sizes that must agree, the batch arithmetic, and every rank's program against the layout."""
    if plan.schema_version != SCHEMA_VERSION:
        raise RuntimeSetupError(f"plan schema_version is {plan.schema_version} but this runtime runs "
                                f"version {SCHEMA_VERSION}; re-create the plan with `tessera plan`")
    try:
        check_invariants(plan)  # the plan file's own checks (planner/plan/invariants.py)
    except PlanFileError as error:
        raise RuntimeSetupError(str(error)) from None
    try:
        validate(programs(plan), plan.layout, edges={(t.src_stage, t.dst_stage) for t in plan.transfers})
    except ScheduleError as error:
        raise RuntimeSetupError(f"the plan's programs cannot run: {error.reason}; re-create it with "
                                f"`tessera plan`") from None


def programs(plan: Plan) -> tuple[Program, ...]:
    """Every rank's parsed program; a malformed action is a set-up error."""
    try:
        return parse_programs(plan.programs)
    except ValueError as error:
        raise RuntimeSetupError(f"the plan's programs are malformed: {error}") from None


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_dtype(precision: Precision) -> torch.dtype:
    """The dtype a plan's model is built and traced in: the precision's own, or for mixed precision
    (fp16/bf16) float32, the dtype of the master weights the runtime keeps (it casts a copy to 16 bits).

    >>> build_dtype(Precision.BF16), build_dtype(Precision.FP64)
    (torch.float32, torch.float64)
    """
    return torch.float32 if precision.master_weights else getattr(torch, precision.dtype)


def rebuild_model(plan: Plan, search_root: Path | None = None) -> nn.Module:
    """The plan's model from its builder, on the meta device, in the plan's :func:`build_dtype`."""
    from cost_models.graph.model_spec import build_model, resolve_builder

    if not plan.model.builder:
        raise RuntimeSetupError("the plan records no model builder (it was planned from a Python "
                                "object); run it from your script with runtime.Executor(plan, model, ...)")
    builder, _ = resolve_builder(plan.model.builder_specs, search_root)  # absolute path, then as given
    with default_dtype(build_dtype(plan.model.precision)):
        return build_model(builder, dict(plan.model.builder_kwargs), "meta")


def meta_inputs(plan: Plan) -> tuple[torch.Tensor, ...]:
    """Meta tensors of the plan's example input shapes (the traced batch size)."""
    return tuple(torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device="meta")
                 for meta in plan.model.example_inputs)


def trace_checked(model: nn.Module, plan: Plan,
                  leaf_modules: Sequence[LeafSpec] = ()) -> torch.fx.GraphModule:
    """Capture as the planner did (with the plan's leaf modules and any given) and check the fingerprint
    (nothing is costed); returns the GraphModule."""
    from cost_models.graph.tracing import rebuild_graph

    leaf_modules = tuple(dict.fromkeys((*plan.model.leaf_modules, *leaf_modules)))
    graph, traced = rebuild_graph(model, meta_inputs(plan), leaf_modules)
    if graph.fingerprint != plan.model.fingerprint:
        raise RuntimeSetupError(
            f"the rebuilt model's graph fingerprint {graph.fingerprint[:16]}... differs from the "
            f"plan's {plan.model.fingerprint[:16]}... (builder {plan.model.builder!r}, arguments "
            f"{dict(plan.model.builder_kwargs)}, precision {plan.model.precision.value}, inputs "
            f"{[m.shape for m in plan.model.example_inputs]}): the model changed since planning, or "
            f"it is built with other arguments or leaf modules. Re-plan it with `tessera plan`")
    known = {node.name for node in traced.graph.nodes}
    missing = sorted(known - set(plan.part_of()))
    if missing:
        raise RuntimeSetupError(f"nodes {missing[:5]} of the model are in no stage of the plan; "
                                f"re-create the plan with `tessera plan`")
    return traced


def check_one_output(traced: torch.fx.GraphModule) -> None:
    """`tessera run` trains on synthetic data with the loss after the model's output (cost_models/loss.py),
    which must be one tensor: a model returning several values trains from the user's own script."""
    output = next(node for node in traced.graph.nodes if node.op == "output")
    returned = output.args[0]
    if isinstance(returned, torch.fx.Node):
        return
    kind = "dict" if isinstance(returned, dict) else "tuple" if isinstance(returned, (tuple, list)) else None
    what = f"a {kind} of {plural(len(returned), 'value')}" if kind else repr(returned)
    raise RuntimeSetupError(f"the runtime trains on synthetic data with a loss after the model's one output tensor, but "
                            f"this model returns {what}; train it from your own script with runtime.Executor and a "
                            f"loss taking {'that ' + kind if kind else 'it'}, or return one tensor")

