"""Rank functions and the single-process float64 reference for the runtime's dist tests."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from planner.plan import Plan
from runtime.build import rebuild_model, trace_checked
from runtime.data import SyntheticData, input_specs, synthetic_task
from runtime.executor import Executor
from runtime.optim import optimizer_factory
from runtime.recompute import Checkpointed
from runtime.stages import stage_state_tensors
from runtime.values import value_specs
from runtime.weights import initialize

SEED = 7
RTOL, ATOL = 1e-10, 1e-12


@dataclass(frozen=True)
class Case:
    plan_json: str
    steps: int = 3
    lr: float = 0.05
    real_weights: bool = False  # pass a fully initialised model instead of a meta one
    nvme_dir: str | None = None  # for plans that page optimizer state to NVMe


@dataclass
class Outcome:
    """What a run produced: the loss per step, the last step's gradients, the final parameters and
    buffers (batch-norm running statistics).

    Arrays are numpy (pickled by value: torch tensors would travel by shared-memory handles
    that die with the child process).
    """

    losses: list[float]
    grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    checkpointed: int = 0  # Checkpointed regions in this rank's stage modules
    swapped_bytes: int = 0  # saved activations this rank copied to the host in the last step
    halo_bytes_sent: int = 0  # what this rank's halo exchanges sent in the last step (the run report's)


def _recording(name: str, lr: float, grads: dict[int, torch.Tensor]) -> Any:
    make = optimizer_factory(name, lr)

    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = make(params)

        def record(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for group in opt.param_groups:  # a step in buckets (StageOptimizer.step) calls it per bucket
                for param in group["params"]:
                    if param.grad is not None:
                        grads[id(param)] = param.grad.detach().clone()
        optimizer.register_step_pre_hook(record)
        return optimizer
    return factory


def run_cases(rank: int, world_size: int, cases: list[Case]) -> list[Outcome]:
    """Rank function: train every case with the Executor; report this rank's stages."""
    return [run_case(case) for case in cases]


def run_case(case: Case) -> Outcome:
    """Train one case with the Executor on this rank (joining the group itself under torchrun)."""
    grads: dict[int, torch.Tensor] = {}
    exe, data = _executor(case.plan_json, case, grads)
    losses = _train(exe, data, range(case.steps))
    return _outcome(exe, losses, grads)


@dataclass(frozen=True)
class Resumed:
    """Train ``case`` for ``stop_after`` steps, checkpoint to ``checkpoint_dir``, then resume in a
    new Executor (under ``resume_plan_json``: the same model and cut, other offload decisions)."""

    case: Case
    checkpoint_dir: str
    stop_after: int
    resume_plan_json: str | None = None
    resume_nvme_dir: str | None = None


def run_resumed(rank: int, world_size: int, cases: list[Resumed]) -> list[Outcome]:
    """Rank function: each case interrupted by a checkpoint and resumed from it."""
    from runtime import checkpoint

    outcomes = []
    for resumed in cases:
        case, folder = resumed.case, Path(resumed.checkpoint_dir)
        first, data = _executor(case.plan_json, case, None)
        losses = _train(first, data, range(resumed.stop_after))
        checkpoint.save(first, folder, resumed.stop_after)
        _close(first)
        grads: dict[int, torch.Tensor] = {}
        second, data = _executor(resumed.resume_plan_json or case.plan_json,
                                 dataclasses.replace(case, nvme_dir=resumed.resume_nvme_dir or case.nvme_dir),
                                 grads)
        checkpoint.restore(second, folder, resumed.stop_after)
        losses += _train(second, data, range(resumed.stop_after, case.steps))
        outcomes.append(_outcome(second, losses, grads))
    return outcomes


def _executor(plan_json: str, case: Case,
              grads: dict[int, torch.Tensor] | None) -> tuple[Executor, SyntheticData]:
    """The case's Executor and data; its optimizer records each gradient it steps into ``grads`` (None: the
    plan's optimizer as `tessera run` makes it, where a test measures memory the copies would add to)."""
    plan = Plan.from_dict(json.loads(plan_json))
    model = initialize(rebuild_model(plan), SEED) if case.real_weights else rebuild_model(plan)
    factory = (optimizer_factory(plan.training.optimizer, case.lr) if grads is None
               else _recording(plan.training.optimizer, case.lr, grads))
    exe = Executor(plan, model, _no_loss, factory, seed=SEED, timeout_s=60, nvme_dir=case.nvme_dir)
    data = SyntheticData(input_specs(exe.traced, dict(exe.flow.specs)),
                         synthetic_task(exe.flow.specs[exe.flow.output_names[0]]), SEED)
    exe.loss_fn = data.task
    return exe, data


def _train(exe: Executor, data: SyntheticData, steps: range) -> list[float]:
    losses = []
    size = exe.plan.training.global_batch_size
    for step in steps:  # the user's API: the whole global batch on every rank (and the next one's inputs)
        batch = data.samples(step, 0, size)
        following = data.samples(step + 1, 0, size).inputs if step + 1 in steps else None
        losses.append(exe.step(batch.inputs, batch.targets, next_inputs=following))
    return losses


def _outcome(exe: Executor, losses: list[float], grads: dict[int, torch.Tensor]) -> Outcome:
    """The last step's gradients and the parameters, whole (gathered from ZeRO shards), the buffers,
    the checkpointed regions and the bytes swapped to the host."""
    model_buffers = {name for name, _ in exe.model.named_buffers()}
    buffers = {name: t for stage in exe.stages.values()
               for name, t in stage_state_tensors(exe.model, stage).items() if name in model_buffers}
    outcome = Outcome(losses, {}, {}, {name: t.detach().cpu().numpy().copy() for name, t in buffers.items()},
                      sum(isinstance(m, Checkpointed) for stage in exe.stages.values() for m in stage.module.modules()),
                      exe.swaps.step_bytes, exe.halo_bytes_sent)
    for stage in sorted(exe.stages.values(), key=lambda local: local.index):
        if stage.state is None:
            continue
        # the optimizer steps masters (shards under ZeRO): gather what it saw into whole gradients
        seen = stage.state.gather_full([grads.get(id(master)) for master in stage.state.masters])
        with stage.state.params_gathered():
            for name, param, grad in zip(stage.state.names, stage.state.params, seen):
                assert grad is not None, f"stage {stage.index} stepped {name} without a gradient"
                outcome.grads[name] = grad.cpu().numpy().copy()
                outcome.params[name] = param.detach().cpu().clone().numpy()  # numpy() pins the storage
    _close(exe)
    return outcome


def _close(exe: Executor) -> None:
    for stage in exe.stages.values():
        if stage.state is not None:
            stage.state.close()
    dist.barrier()


def _no_loss(output: Any, target: Any) -> torch.Tensor:
    raise AssertionError("bound after set-up")


def reference(case: Case, prediction: Callable[[Any], torch.Tensor] = lambda output: output) -> Outcome:
    """One process, the whole model: the same initialisation, micro-batches, loss and optimizer.

    The eager model runs, not a traced graph; ``prediction`` takes what the loss reads from its
    output (e.g. a Hugging Face ModelOutput's ``logits``)."""
    plan = Plan.from_dict(json.loads(case.plan_json))
    model = initialize(rebuild_model(plan), SEED)
    traced = trace_checked(model, plan)
    inputs = [(meta.shape, getattr(torch, meta.dtype)) for meta in plan.model.example_inputs]
    specs = value_specs(traced, inputs, plan.training.micro_batch_size)
    output = next(node for node in traced.graph.nodes if node.op == "output").all_input_nodes[0].name
    data = SyntheticData(input_specs(traced, specs), synthetic_task(specs[output]), SEED)
    grads: dict[int, torch.Tensor] = {}
    optimizer = _recording(plan.training.optimizer, case.lr, grads)(list(model.parameters()))
    total = plan.training.num_microbatches * plan.data_parallel
    size = plan.training.micro_batch_size
    losses = []
    for step in range(case.steps):
        step_losses = []
        batch = data.samples(step, 0, plan.training.global_batch_size)  # sample i: seeded by (step, i)
        for index in range(total):
            rows = slice(index * size, (index + 1) * size)
            loss = data.task(prediction(model(*(x[rows] for x in batch.inputs))), batch.targets[rows])
            (loss / total).backward()
            step_losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / total)
    named = dict(model.named_parameters())
    return Outcome(losses, {name: grads[id(p)].numpy() for name, p in named.items()},
                   {name: p.detach().numpy().copy() for name, p in named.items()},
                   {name: b.detach().numpy().copy() for name, b in model.named_buffers()})


def check_outcomes(expected: Outcome, case: Case, by_rank: list[Outcome], *, rtol: float = RTOL,
                   atol: float = ATOL) -> None:
    """Every rank's losses, gradients, parameters and buffers equal ``expected`` at float64 precision
    (``rtol``/``atol``: a GPU's float64 kernels sum in another order than the CPU's)."""
    layout = Plan.from_dict(json.loads(case.plan_json)).layout
    replicas = layout.data_parallel * layout.num_copies  # data-parallel replicas and a GEMS mirror's copies
    seen: set[str] = set()
    buffers_seen: set[str] = set()
    for rank, outcome in enumerate(by_rank):
        np.testing.assert_allclose(outcome.losses, expected.losses, rtol=rtol, atol=atol,
                                   err_msg=f"rank {rank} losses")
        for name, grad in outcome.grads.items():
            np.testing.assert_allclose(grad, expected.grads[name], rtol=rtol, atol=atol,
                                       err_msg=f"rank {rank} gradient of {name}")
            np.testing.assert_allclose(outcome.params[name], expected.params[name], rtol=rtol,
                                       atol=atol, err_msg=f"rank {rank} parameter {name}")
        seen |= set(outcome.grads)
        if replicas == 1:  # replicas and copies see different samples: their running statistics differ
            for name, buffer in outcome.buffers.items():
                np.testing.assert_allclose(buffer, expected.buffers[name], rtol=rtol, atol=atol,
                                           err_msg=f"rank {rank} buffer {name}")
            buffers_seen |= set(outcome.buffers)
    assert seen == set(expected.grads), f"parameters on no rank: {sorted(set(expected.grads) - seen)}"
    if replicas == 1:
        assert buffers_seen == set(expected.buffers), f"buffers on no rank: {set(expected.buffers) - buffers_seen}"
