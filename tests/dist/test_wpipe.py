"""WPipe plans that the search chose (``plan(..., schedules=("wpipe",), allow_stale_weights=True)``) run and
equal a single-process emulation of WPipe's update rule, written here without the runtime: the first
half of the model's parts computes step p on the weights from before step p-1's update (step 0 on the
initial ones), the second half on the current weights, and every parameter steps on the sum of the
gradients its uses produced. Over 6 steps on 2 and 4 ranks, with the tiny GPT (its embedding, in the
first group, tied to the LM head, in the second: one tensor read at two versions) and ResNet
(skip connections across stages, batch-norm statistics). A synchronous reference differs from
step 1 on, so the emulation is what is checked. Also: a `tessera run` that checkpoints and one resumed
from its checkpoint, and hand-made plans in bf16 and fp16 against the emulation in mixed precision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cost_models.memory import Precision
from planner.manual import reschedule
from planner.plan import Plan
from planner.reports.run_report import RunReport
from runtime.build import rebuild_model, trace_checked
from runtime.data import SyntheticData, input_specs, synthetic_task
from runtime.optim import optimizer_factory
from runtime.precision import compute_dtype
from runtime.values import value_specs
from runtime.weights import initialize
from tests.dist.harness import run_ranks
from tests.dist.precision_cases import (
    MixedCase,
    MixedOutcome,
    _next_scale,
    reference_data,
    run_mixed_cases,
    step_masters,
)
from tests.dist.runtime_cases import SEED, Case, Outcome, _recording, check_outcomes, reference, run_cases
from tests.dist.test_tessera_run import _one_error_line, tessera
from tests.runtime_plans import GPT, RESNET, make_plan, searched_plan

pytestmark = pytest.mark.dist

STEPS = 6


class _TwoVersions(torch.fx.Interpreter):
    """Runs the traced model with the nodes in ``stale_nodes`` reading ``stale`` weights, the rest ``fresh``."""

    def __init__(self, module: torch.fx.GraphModule, stale_nodes: set[str], stale: dict[str, torch.Tensor],
                 fresh: dict[str, torch.Tensor]) -> None:
        super().__init__(module)
        self.stale_nodes, self.stale, self.fresh = stale_nodes, stale, fresh
        self.node_name = ""

    def _weights(self) -> dict[str, torch.Tensor]:
        return self.stale if self.node_name in self.stale_nodes else self.fresh

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node_name = n.name
        return super().run_node(n)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._weights().get(target, super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(target)
        weights = self._weights()
        mine = {local: weights[f"{target}.{local}"] for local, _ in module.named_parameters()}
        return torch.func.functional_call(module, mine, args, kwargs)


def _step_on_two_versions(plan: Plan, traced: torch.fx.GraphModule, stale_nodes: set[str],
                          named: dict[str, torch.Tensor], stale_weights: dict[str, torch.Tensor],
                          data: SyntheticData, step: int, *, loss_scale: float | None = None,
                          loss_dtype: torch.dtype | None = None) -> float:
    """Step ``step``'s micro-batches under WPipe's rule: the nodes of ``stale_nodes`` read copies of
    ``stale_weights``, the rest ``named``; each micro-batch's loss (on the output cast to ``loss_dtype``, times
    ``loss_scale`` where given) over their count backpropagated; then the copies' gradients added to the
    parameters' (after theirs). Returns the step's mean loss."""
    stale = {name: w.clone().requires_grad_() for name, w in stale_weights.items()}
    run = _TwoVersions(traced, stale_nodes, stale, named)
    batch = data.samples(step, 0, plan.training.global_batch_size)
    total, size = plan.training.num_microbatches * plan.data_parallel, plan.training.micro_batch_size
    losses = []
    for index in range(total):
        rows = slice(index * size, (index + 1) * size)
        output = run.run(*(x[rows] for x in batch.inputs))
        loss = data.task(output if loss_dtype is None else output.to(loss_dtype), batch.targets[rows])
        ((loss if loss_scale is None else loss * loss_scale) / total).backward()
        losses.append(loss.item())
    for name, p in named.items():
        if stale[name].grad is not None:
            p.grad = stale[name].grad if p.grad is None else p.grad + stale[name].grad
    return sum(losses) / total


def wpipe_emulation(case: Case) -> Outcome:
    plan = Plan.from_dict(json.loads(case.plan_json))
    model = initialize(rebuild_model(plan), SEED)
    traced = trace_checked(model, plan)
    first_group = range(plan.layout.num_parts // 2)
    stale_nodes = {node for part in first_group for node in plan.stages[part].nodes}
    inputs = [(meta.shape, getattr(torch, meta.dtype)) for meta in plan.model.example_inputs]
    specs = value_specs(traced, inputs, plan.training.micro_batch_size)
    output = next(node for node in traced.graph.nodes if node.op == "output").all_input_nodes[0].name
    data = SyntheticData(input_specs(traced, specs), synthetic_task(specs[output]), SEED)
    named = dict(traced.named_parameters())
    grads: dict[int, torch.Tensor] = {}
    optimizer = _recording(plan.training.optimizer, case.lr, grads)(list(named.values()))
    before_last_update = {name: p.detach().clone() for name, p in named.items()}  # W(-1) = W(0)
    losses = []
    for step in range(case.steps):
        losses.append(_step_on_two_versions(plan, traced, stale_nodes, named, before_last_update, data, step))
        before_last_update = {name: p.detach().clone() for name, p in named.items()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return Outcome(losses, {name: grads[id(p)].numpy() for name, p in named.items()},
                   {name: p.detach().numpy().copy() for name, p in named.items()},
                   {name: b.detach().numpy().copy() for name, b in traced.named_buffers()})


def _cases(ranks: int) -> list[Case]:
    return [Case(searched_plan(model, gpus=ranks, budget_share=4.0, offload=(), schedule="wpipe", batch_size=8,
                               micro_batch_size=2, allow_stale_weights=True), steps=STEPS)
            for model in (GPT, RESNET)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_searched_wpipe_plans_equal_an_emulation_of_its_update_rule(ranks: int) -> None:
    cases = _cases(ranks)
    for case in cases:
        searched = Plan.from_dict(json.loads(case.plan_json))
        assert searched.schedule.kind.value == "wpipe" and searched.layout.world_size == ranks
        assert searched.layout.num_parts == 2 * ranks
    outcomes = run_ranks(run_cases, ranks, cases, timeout_s=300)
    for index, case in enumerate(cases):
        by_rank = [outcomes[rank][index] for rank in range(ranks)]
        emulated = wpipe_emulation(case)
        check_outcomes(emulated, case, by_rank)
        synchronous = reference(case)  # the emulation is not the synchronous rule: the check can fail
        assert emulated.losses[0] == pytest.approx(synchronous.losses[0], rel=1e-12)
        assert not np.allclose(emulated.losses[1:], synchronous.losses[1:], rtol=1e-6, atol=0)


def _final_state(checkpoints: Path, step: int) -> dict[str, np.ndarray]:
    """Every stage's parameters and buffers in the checkpoint of ``step``, by model name."""
    state: dict[str, np.ndarray] = {}
    for stage_file in sorted((checkpoints / f"step-{step:08d}").glob("stage-*.pt")):
        state.update({name: t.numpy() for name, t in torch.load(stage_file, weights_only=True)["model"].items()})
    return state


def test_a_wpipe_run_checkpoints_and_resumes_on_its_update_rule(tmp_path: Path) -> None:
    """`tessera run` of a WPipe plan checkpointing every 2 steps flushes before each checkpoint and saves the
    first group's stashed version; a run resumed from step 2 reads it. Both runs' losses, and the weights
    and batch-norm statistics (in the first group: a forward run ahead before a checkpoint would update them
    twice) of their last checkpoints, equal the emulation's over 6 steps. A synchronous plan's checkpoint of
    the same cut holds no stashed version: resuming it is refused in one line."""
    case = _cases(2)[1]
    plan_file, checkpoints = tmp_path / "wpipe.json", tmp_path / "checkpoints"
    plan_file.write_text(case.plan_json)
    common = ("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2", "--seed", str(SEED), "--lr", str(case.lr))
    straight = tessera("run", str(plan_file), "--steps", str(STEPS), "--", *common,
                       "--report", str(tmp_path / "straight.json"))
    assert straight.returncode == 0, straight.stderr
    straight_state = _final_state(checkpoints, STEPS)
    latest = json.loads((checkpoints / "latest.json").read_text())
    (checkpoints / "latest.json").write_text(json.dumps({**latest, "step": 2}))  # as if killed before step 4's checkpoint
    resumed = tessera("run", str(plan_file), "--steps", str(STEPS), "--", *common, "--resume",
                      "--report", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr
    whole, after = RunReport.load(tmp_path / "straight.json"), RunReport.load(tmp_path / "resumed.json")
    assert after.start_step == 2
    emulated = wpipe_emulation(Case(case.plan_json, steps=STEPS, lr=case.lr))
    np.testing.assert_allclose(whole.losses, emulated.losses, rtol=1e-10, atol=0)
    np.testing.assert_allclose(after.losses, emulated.losses[2:], rtol=1e-10, atol=0)
    expected = {**emulated.params, **emulated.buffers}
    for state in (straight_state, _final_state(checkpoints, STEPS)):
        assert set(state) == set(expected)
        for name, tensor in state.items():
            np.testing.assert_allclose(tensor, expected[name], rtol=1e-10, atol=1e-12, err_msg=name)

    synchronous = reschedule(Plan.from_dict(json.loads(case.plan_json)), "interleaved-1f1b", virtual_stages=2)
    synchronous.save(tmp_path / "interleaved.json")
    other = tmp_path / "other"
    wrote = tessera("run", str(tmp_path / "interleaved.json"), "--steps", "1", "--", "--checkpoint-dir", str(other))
    assert wrote.returncode == 0, wrote.stderr
    refused = tessera("run", str(plan_file), "--steps", "2", "--", "--checkpoint-dir", str(other), "--resume")
    assert refused.returncode == 2, refused.stderr
    assert _one_error_line(refused.stderr, "holds no stashed weight versions"), refused.stderr


def wpipe_mixed_emulation(case: MixedCase) -> MixedOutcome:
    """WPipe's rule (:func:`wpipe_emulation`) in mixed precision, as tests/dist/precision_cases.py's loop runs it:
    16-bit weights computing (the first group's at their version from before the last update), their gradients
    added in 16 bits, the loss scaled under fp16, fp32 masters stepped on the unscaled gradients and copied back
    into the 16-bit weights; a step with a non-finite gradient skipped."""
    plan = Plan.from_dict(json.loads(case.plan_json))
    model = initialize(rebuild_model(plan), SEED)  # float32: the masters' values
    traced = trace_checked(model, plan)
    named = dict(traced.named_parameters())
    masters = {name: torch.nn.Parameter(p.detach().clone()) for name, p in named.items()}
    traced.to(compute_dtype(plan.model.precision))
    stale_nodes = {node for part in range(plan.layout.num_parts // 2) for node in plan.stages[part].nodes}
    data = reference_data(plan)
    optimizer = optimizer_factory(plan.training.optimizer, case.lr)(list(masters.values()))
    scaled = plan.model.precision is Precision.FP16
    scale, good_steps, skipped = case.init_scale, 0, 0
    before_last_update = {name: p.detach().clone() for name, p in named.items()}
    losses, scales = [], []
    for step in range(case.steps):
        losses.append(_step_on_two_versions(plan, traced, stale_nodes, named, before_last_update, data, step,
                                            loss_scale=scale if scaled else None, loss_dtype=torch.float32))
        before_last_update = {name: p.detach().clone() for name, p in named.items()}
        finite = step_masters(optimizer, masters, named, {name: p.grad for name, p in named.items()},
                              1.0 / scale if scaled else None)
        skipped += int(scaled and not finite)
        for p in named.values():
            p.grad = None
        if scaled:
            scale, good_steps = _next_scale(scale, good_steps, finite, case.growth_interval)
        scales.append(scale if scaled else 1.0)
    return MixedOutcome(losses, {n: m.detach().to(torch.float64).numpy() for n, m in masters.items()},
                        {n: p.detach().to(torch.float64).numpy() for n, p in named.items()}, scales, skipped)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_wpipe_run_equals_an_emulation_of_its_rule(precision: str) -> None:
    """The first group's stashed versions are 16-bit copies of its weights; the masters stay fp32. Over 6 steps on
    2 ranks (4 parts; GPT's embedding in the first group read at the old version, its LM head in the second at
    the new one), under fp16 from a scale of 2^16, whose first step overflows and is skipped: the losses,
    masters and 16-bit weights equal the emulation's."""
    case = MixedCase(make_plan(GPT, ["blocks_0_ln_2", "blocks_1_ln_1", "blocks_1_ln_2"], schedule="wpipe",
                               precision=precision, device="A100-40GB", allow_stale_weights=True), steps=STEPS)
    by_rank = [outcome[0] for outcome in run_ranks(run_mixed_cases, 2, [case], timeout_s=300)]
    torch.set_num_threads(1)  # as the children run (LayerNorm's weight gradient is summed per thread)
    expected = wpipe_mixed_emulation(case)
    seen: set[str] = set()
    for rank, outcome in enumerate(by_rank):
        np.testing.assert_allclose(outcome.losses, expected.losses, rtol=1e-12, err_msg=f"rank {rank} losses")
        assert (outcome.scales, outcome.skipped) == (expected.scales, expected.skipped)
        for name, master in outcome.masters.items():
            np.testing.assert_array_equal(master, expected.masters[name], err_msg=f"rank {rank} master {name}")
            np.testing.assert_array_equal(outcome.weights[name], expected.weights[name], err_msg=name)
        seen |= set(outcome.masters)
    assert seen == set(expected.masters)
    assert expected.skipped == (1 if precision == "fp16" else 0)
