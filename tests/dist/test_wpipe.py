"""WPipe plans that the search chose (``plan(..., schedules=("wpipe",), allow_stale_weights=True)``) run and
equal a single-process emulation of WPipe's update rule, written here without the runtime: the first
half of the model's parts computes step p on the weights from before step p-1's update (step 0 on the
initial ones), the second half on the current weights, and every parameter steps on the sum of the
gradients its uses produced. Over 6 steps on 2 and 4 ranks, with the tiny GPT (its embedding, in the
first group, tied to the LM head, in the second: one tensor read at two versions) and ResNet
(skip connections across stages, batch-norm statistics). A synchronous reference differs from
step 1 on, so the emulation is what is checked.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from planner.plan import Plan
from runtime.build import rebuild_model, trace_checked
from runtime.data import SyntheticData, input_specs, synthetic_task
from runtime.values import value_specs
from runtime.weights import initialize
from tests.dist.harness import run_ranks
from tests.dist.runtime_cases import SEED, Case, Outcome, _recording, check_outcomes, reference, run_cases
from tests.runtime_plans import GPT, RESNET, searched_plan

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
    total, size = plan.training.num_microbatches * plan.data_parallel, plan.training.micro_batch_size
    before_last_update = {name: p.detach().clone() for name, p in named.items()}  # W(-1) = W(0)
    losses = []
    for step in range(case.steps):
        stale = {name: w.clone().requires_grad_() for name, w in before_last_update.items()}
        run = _TwoVersions(traced, stale_nodes, stale, named)
        batch = data.samples(step, 0, plan.training.global_batch_size)
        step_losses = []
        for index in range(total):
            rows = slice(index * size, (index + 1) * size)
            loss = data.task(run.run(*(x[rows] for x in batch.inputs)), batch.targets[rows])
            (loss / total).backward()
            step_losses.append(loss.item())
        for name, p in named.items():
            if stale[name].grad is not None:
                p.grad = stale[name].grad if p.grad is None else p.grad + stale[name].grad
        before_last_update = {name: p.detach().clone() for name, p in named.items()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / total)
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
