"""Rank functions for the mixed-precision dist tests, and their single-process reference.

The reference does not use runtime/precision.py: it is the textbook loop written out. The model
initialised in float32, fp32 master copies of its parameters, the model cast to the 16-bit
dtype; per micro-batch the loss in fp32 of the output cast to fp32, times the loss scale (fp16),
divided by the micro-batch count, backward into 16-bit gradients; at the step the 16-bit gradients
(summed over replicas, each replica's accumulated on its own as a data-parallel rank does) become
the masters' gradients times 1/scale, a non-finite one skips the step, the optimizer steps the
masters, the 16-bit weights are the masters rounded. The scale follows GradScaler's rule.

One pipeline fact the reference reproduces so that the comparison can be exact: GPT's token
embedding and LM head share a weight, and when they sit on different stages each stage
accumulates its own use's gradient over the micro-batches and the two sums are added at the step
(runtime/grads.py), where one autograd graph adds the two uses per micro-batch. In fp16 those
additions round differently, so with several stages the reference's lookup reads its own copy
of the tied weight (:class:`SplitTie`) and the copies' gradients are added at the step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from planner.plan import Plan
from runtime import checkpoint
from runtime.build import rebuild_model, trace_checked
from runtime.data import SyntheticData, input_specs, synthetic_task
from runtime.executor import Executor
from runtime.optim import optimizer_factory
from runtime.precision import ScalerOptions
from runtime.values import value_specs
from runtime.weights import initialize

SEED = 7
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class MixedCase:
    plan_json: str
    steps: int = 3
    lr: float = 0.05
    init_scale: float = 2.0 ** 16
    growth_interval: int = 2000
    inf_at: tuple[int, str] | None = None  # (step, parameter): its gradient is made inf in that step
    checkpoint_dir: str | None = None  # save after ``resume_at`` steps, train on in a new Executor
    resume_at: int = 0
    nvme_dir: str | None = None  # for plans that page optimizer state to NVMe


@dataclass
class MixedOutcome:
    """Losses per step, final fp32 masters and 16-bit weights (as float64 numpy), the scale per step."""

    losses: list[float]
    masters: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]
    scales: list[float]  # the loss scale after each step
    skipped: int
    model_state_bytes: int = 0
    param_numel: int = 0
    optimizer_states: int = 0  # optimizer state tensors per parameter
    halo_bytes_sent: int = 0  # what this rank's halo exchanges sent in the last step (the run report's)


def _dtype(plan: Plan) -> torch.dtype:
    return DTYPES[plan.model.precision.value]


def _inject(param: torch.nn.Parameter, step: int, current_step: Any) -> None:
    def make_inf(tensor: torch.Tensor) -> None:
        if current_step() == step:
            assert tensor.grad is not None
            tensor.grad.fill_(math.inf)
    param.register_post_accumulate_grad_hook(make_inf)


def run_mixed_cases(rank: int, world_size: int, cases: list[MixedCase]) -> list[MixedOutcome]:
    """Rank function: train every case with the Executor; report this rank's stages."""
    return [run_mixed_case(case) for case in cases]


def _executor(case: MixedCase, plan: Plan) -> tuple[Executor, SyntheticData]:
    options = ScalerOptions(init_scale=case.init_scale, growth_interval=case.growth_interval)
    exe = Executor(plan, rebuild_model(plan), _no_loss, optimizer_factory(plan.training.optimizer, case.lr),
                   seed=SEED, timeout_s=60, loss_scale=options, nvme_dir=case.nvme_dir)
    data = SyntheticData(input_specs(exe.traced, dict(exe.flow.specs)),
                         synthetic_task(exe.flow.specs[exe.flow.output_names[0]]), SEED)
    exe.loss_fn = data.task
    return exe, data


def run_mixed_case(case: MixedCase) -> MixedOutcome:
    """Train with the Executor (with a checkpoint and a fresh Executor half-way if the case asks)."""
    plan = Plan.from_dict(json.loads(case.plan_json))
    exe, data = _executor(case, plan)
    params = {name: p for stage in exe.stages.values() for name, p in stage.params.items()}
    if case.inf_at is not None and case.inf_at[1] in params:
        _inject(params[case.inf_at[1]], case.inf_at[0], lambda: exe.steps_done)
    losses, scales = [], []
    for step in range(case.steps):
        if case.checkpoint_dir is not None and step == case.resume_at:
            checkpoint.save(exe, Path(case.checkpoint_dir), step)
            exe, data = _executor(case, plan)  # a new job: fresh weights, masters and scale
            checkpoint.restore(exe, Path(case.checkpoint_dir), step)
            params = {name: p for stage in exe.stages.values() for name, p in stage.params.items()}
        batch = data.samples(step, 0, plan.training.global_batch_size)
        following = None  # a plan whose forwards run ahead (WPipe) takes the next step's inputs; others ignore them
        if step + 1 < case.steps:
            following = data.samples(step + 1, 0, plan.training.global_batch_size).inputs
        losses.append(exe.step(batch.inputs, batch.targets, next_inputs=following))
        assert exe.mixed is not None
        scales.append(exe.mixed.loss_scale)
    assert exe.mixed is not None
    masters, weights = {}, {}
    for index in sorted(exe.mixed.states):  # whole masters and weights (gathered from ZeRO shards)
        state = exe.mixed.states[index]
        masters.update(zip(state.names, state.full_masters()))
        with state.params_gathered():
            weights.update(_numpy(dict(zip(state.names, state.params))))
        state.close()
    optimizer_states = {len(state) for stage in exe.stages.values() if stage.optimizer is not None
                        for state in stage.optimizer.state.values()}
    dist.barrier()
    return MixedOutcome(losses, _numpy(masters), weights, scales, exe.mixed.skipped_steps,
                        exe.memory.model_state_bytes(), sum(p.numel() for p in params.values()),
                        max(optimizer_states, default=0), exe.halo_bytes_sent)


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: t.detach().to(torch.float64).numpy().copy() for name, t in tensors.items()}


def _no_loss(output: Any, target: Any) -> torch.Tensor:
    raise AssertionError("bound after set-up")


def mixed_reference(case: MixedCase) -> MixedOutcome:
    """One process, the whole model, the loop of the module docstring."""
    plan = Plan.from_dict(json.loads(case.plan_json))
    dtype, training = _dtype(plan), plan.training
    model = initialize(rebuild_model(plan), SEED)  # float32: the masters' values
    named = dict(model.named_parameters())
    masters = {name: torch.nn.Parameter(p.detach().clone()) for name, p in named.items()}
    model.to(dtype)
    tie = SplitTie(model.wte.weight) if plan.num_stages > 1 else None
    if tie is not None:
        model.wte = tie
    optimizer = optimizer_factory(training.optimizer, case.lr)(list(masters.values()))
    data = reference_data(plan)
    if case.inf_at is not None:
        done = [0]
        _inject(named[case.inf_at[1]], case.inf_at[0], lambda: done[0])
    scaled = plan.model.precision.value == "fp16"
    scale, good_steps, skipped = case.init_scale, 0, 0
    total, size = training.num_microbatches * plan.data_parallel, training.micro_batch_size
    losses, scales = [], []
    for step in range(case.steps):
        batch = data.samples(step, 0, training.global_batch_size)
        made: list[list[dict[str, torch.Tensor]]] = []  # per replica, per micro-batch: each gradient
        step_losses = []
        for replica in range(plan.data_parallel):
            made.append([])
            for microbatch in range(training.num_microbatches):
                rows = slice((replica * training.num_microbatches + microbatch) * size,
                             (replica * training.num_microbatches + microbatch + 1) * size)
                loss = data.task(model(batch.inputs[0][rows]).to(torch.float32), batch.targets[rows])
                ((loss * scale if scaled else loss) / total).backward()
                step_losses.append(loss.item())
                grads = {name: param.grad for name, param in named.items()}
                if tie is not None:  # the embedding's own copy (the two stages' copies are summed apart)
                    grads["lookup"], tie.lookup.grad = tie.lookup.grad, None
                made[-1].append(grads)
                for param in named.values():
                    param.grad = None
        summed = _summed_as_the_runtime_does(plan, made, tie is not None)
        losses.append(sum(step_losses) / total)
        finite = step_masters(optimizer, masters, named, summed, 1.0 / scale if scaled else None)
        if (finite or not scaled) and tie is not None:
            with torch.no_grad():
                tie.lookup.copy_(tie.weight)
        skipped += int(scaled and not finite)
        if scaled:
            scale, good_steps = _next_scale(scale, good_steps, finite, case.growth_interval)
        scales.append(scale if scaled else 1.0)
        if case.inf_at is not None:
            done[0] += 1
    return MixedOutcome(losses, _numpy(dict(masters)), _numpy(named), scales, skipped)


def _summed_as_the_runtime_does(plan: Plan, made: list[list[dict[str, torch.Tensor]]],
                                tied: bool) -> dict[str, torch.Tensor]:
    """Each parameter's gradients ``made[replica][microbatch]`` summed in the runtime's order: each replica's over
    its micro-batches, then over the replicas (the all-reduce at the step), the tied copies added per replica
    (the tied all-reduce); a ZeRO-3 stage's layers reduce-scatter each micro-batch's at once (runtime/
    layer_gathers.py), so theirs are summed over the replicas first, then over the micro-batches (the one-stage
    GPT's embedding, also read as its head, is gathered for the whole pass and keeps the first order)."""
    layered = plan.data_parallel > 1 and plan.stages[0].offload.zero_stage == 3 and plan.num_stages == 1
    summed: dict[str, torch.Tensor] = {}
    for name in made[0][0]:
        if name == "lookup":
            continue
        if layered and name != "wte.weight":
            per_microbatch = [_in_order([replica[m][name] for replica in made]) for m in range(len(made[0]))]
            summed[name] = _in_order(per_microbatch)
            continue
        per_replica = [_in_order([grads[name] for grads in replica]) for replica in made]
        if tied and name == "wte.weight":
            per_replica = [total + _in_order([grads["lookup"] for grads in replica])
                           for total, replica in zip(per_replica, made)]
        summed[name] = _in_order(per_replica)
    return summed


def _in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0]
    for tensor in tensors[1:]:
        total = total + tensor
    return total


def step_masters(optimizer: torch.optim.Optimizer, masters: dict[str, nn.Parameter], named: dict[str, torch.Tensor],
                 grads: dict[str, torch.Tensor], inv_scale: float | None) -> bool:
    """The loop's step: the 16-bit gradients ``grads`` (by name) into the fp32 masters, times ``inv_scale``
    (fp16's, None without a loss scale), the masters stepped and copied into the 16-bit weights ``named``
    unless a scaled gradient is not finite; returns whether every gradient was finite."""
    factor = torch.tensor(1.0 if inv_scale is None else inv_scale, dtype=torch.float32)
    for name, master in masters.items():
        master.grad = grads[name].to(torch.float32) * factor
    finite = all(bool(torch.isfinite(m.grad).all()) for m in masters.values())
    if finite or inv_scale is None:
        optimizer.step()
        with torch.no_grad():
            for name, param in named.items():
                param.copy_(masters[name])
    optimizer.zero_grad(set_to_none=True)
    return finite


class SplitTie(nn.Module):
    """GPT's token embedding reading its own copy (``lookup``) of the weight the LM head reads
    (``weight``), so that each use accumulates its gradient apart, as on two pipeline stages."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.lookup = nn.Parameter(weight.detach().clone())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.lookup)


def _next_scale(scale: float, good_steps: int, finite: bool, growth_interval: int) -> tuple[float, int]:
    """GradScaler's rule: halve on an overflow; double after ``growth_interval`` good steps."""
    if not finite:
        return scale * 0.5, 0
    if good_steps + 1 == growth_interval:
        return scale * 2.0, 0
    return scale, good_steps + 1


def reference_data(plan: Plan) -> SyntheticData:
    """The runtime's synthetic data (integer tokens and targets: the same in any precision)."""
    traced = trace_checked(rebuild_model(plan), plan)
    inputs = [(meta.shape, getattr(torch, meta.dtype)) for meta in plan.model.example_inputs]
    specs = value_specs(traced, inputs, plan.training.micro_batch_size)
    output = next(node for node in traced.graph.nodes if node.op == "output").all_input_nodes[0].name
    return SyntheticData(input_specs(traced, specs), synthetic_task(specs[output]), SEED)
