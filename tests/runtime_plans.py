"""Float64 test plans for the runtime: a tiny GPT, a narrow ResNet-50 and a small CNN, cut where asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.build import default_dtype

ROOT = Path(__file__).resolve().parents[1]
GPT = "examples/models/gpt.py:gpt_tiny"
RESNET = "examples/models/resnet.py:resnet50"
CNN = "tests/small_cnn.py:small_cnn"  # 16-bit runs resolve its gradients (see there)


def make_plan(builder: str, stage_starts: list[str], *, schedule: str, data_parallel: int = 1,
              optimizer: str = "momentum", microbatches: int = 4, micro_batch_size: int = 2,
              device: Any = "V100-16GB", offload: list[Any] | None = None,
              precision: str = "fp64", spatial: dict[int, Any] | None = None, allow_stale_weights: bool = False) -> str:
    """A plan (as JSON; float64 unless ``precision`` says otherwise) for one of the test models with
    the given cut on ``device`` (a preset's name or a DeviceSpec); ``offload`` (one
    planner.plan.OffloadSpec per stage) forces memory decisions,
    ``spatial`` (stage -> planner.plan.SpatialSpec) runs stages on image tiles.

    A mixed-precision plan (fp16, bf16) is of the model built in float32, as the runtime rebuilds
    it (planner.preflight.build_dtype: float32 masters, a 16-bit copy computes)."""
    from cost_models.graph.model_spec import build_model, load_builder
    from cost_models.memory import get_precision
    from planner.manual import plan_with_split
    from planner.preflight import build_dtype

    with default_dtype(build_dtype(get_precision(precision))):
        kwargs, inputs = _model_args(builder)
        model = build_model(load_builder(builder), kwargs, "meta")
        plan = plan_with_split(model, example_inputs=inputs, stage_starts=stage_starts,
                               batch_size=micro_batch_size * microbatches * data_parallel,
                               micro_batch_size=micro_batch_size, data_parallel=data_parallel,
                               schedule=schedule, device=device, optimizer=optimizer,
                               precision=precision, builder=builder, builder_kwargs=kwargs,
                               offload=offload, spatial=spatial, allow_stale_weights=allow_stale_weights)
    return plan.to_json()


def _model_args(builder: str) -> tuple[dict[str, Any], torch.Tensor]:
    """The builder's arguments and an example input (images in the dtype the model is built in)."""
    if builder == GPT:
        return {"dropout": 0.0}, torch.empty(1, 32, dtype=torch.long, device="meta")
    image = torch.empty(1, 3, 64, 64, dtype=torch.get_default_dtype(), device="meta")
    return ({} if builder == CNN else {"width": 4, "num_classes": 10}), image


def looped(plan_json: str, ranks: int) -> str:
    """The plan's stages looped over fewer ranks (stage s on slot s % ranks), as interleaved
    schedules place them: each rank runs all forwards of its stages, stage by stage, then all
    backwards in reverse (programs as data, through planner.manual.reschedule)."""
    import json

    from planner.manual import reschedule
    from planner.plan import Layout, Plan
    from planner.schedules import Action, ActionKind, Schedule

    plan = Plan.from_dict(json.loads(plan_json))
    layout = Layout.replicated(tuple(stage % ranks for stage in range(plan.num_stages)))
    microbatches = range(plan.training.num_microbatches)
    compute = tuple(
        tuple(Action(s, ActionKind.F, m) for s in layout.stages_on_slot(slot) for m in microbatches)
        + tuple(Action(s, ActionKind.B, m) for s in reversed(layout.stages_on_slot(slot)) for m in microbatches)
        for slot in range(ranks))
    schedule = Schedule(plan.schedule.kind, plan.training.num_microbatches, layout, compute)
    return reschedule(plan, schedule).to_json()


def scheduled(plan_json: str, kind: str, **options: Any) -> str:
    """The plan's parts under another schedule family, from its generator (planner.manual.reschedule)."""
    import json

    from planner.manual import reschedule
    from planner.plan import Plan

    return reschedule(Plan.from_dict(json.loads(plan_json)), kind, **options).to_json()


def searched_plan(builder: str, *, gpus: int, offload: tuple[str, ...], budget_share: float = 1.0,
                  schedule: str = "gpipe", batch_size: int = 16, micro_batch_size: int = 4,
                  data_parallel: int = 1, optimizer: str = "momentum", allow_stale_weights: bool = False,
                  tightest: bool = False) -> str:
    """A float64 plan the search makes (``plan()``) for a budget ``budget_share`` of the smallest one
    that fits without offload, allowed only the memory decisions ``offload``; or (``tightest``) for the
    smallest the search reports with ``offload`` (a configuration it names fits there)."""
    from cost_models.errors import PlanInfeasible
    from cost_models.graph.model_spec import build_model, load_builder
    from planner import plan

    with default_dtype(torch.float64):
        kwargs, inputs = _model_args(builder)
        model = build_model(load_builder(builder), kwargs, "meta")
    common = dict(gpus=gpus, batch_size=batch_size, example_inputs=inputs, precision="fp64", reserve=0,
                  optimizer=optimizer, micro_batch_sizes=(micro_batch_size,), schedules=(schedule,),
                  data_parallel=(data_parallel,), builder=builder, builder_kwargs=kwargs,
                  allow_stale_weights=allow_stale_weights)

    def least(allowed: tuple[str, ...] | bool) -> int:
        try:
            plan(model, mem=1, offload=allowed, **common)
        except PlanInfeasible as error:
            return error.min_mem_bytes
        raise AssertionError("a 1-byte budget fitted")

    mem = least(offload) if tightest else int(least(False) * budget_share)
    return plan(model, mem=mem, offload=offload, **common).to_json()


def latency_bound_device() -> Any:
    """A V100 computing 1000x slower (fp32 and fp64), with 100 us per message between its tiles: the
    tiles carry the work and every halo message's latency counts, so fusing a block's halos pays."""
    import dataclasses

    from cost_models.devices import get_device

    v100 = get_device("V100-16GB")
    return dataclasses.replace(v100, fp32_tflops=v100.fp32_tflops / 1000, fp64_tflops=v100.fp64_tflops / 1000,
                               mem_bandwidth_gb_per_s=v100.mem_bandwidth_gb_per_s / 1000,
                               kernel_overhead_us=0.0,
                               intra_node=dataclasses.replace(v100.intra_node, latency_us=100.0))
