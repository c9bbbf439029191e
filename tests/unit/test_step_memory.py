"""The optimizer step's own memory: what runtime/stage_optimizer.py allocates, measured with the profiler,
is what cost_models/memory.py says; and a plan whose peak is its optimizer step predicts that peak.

The reference is hand-computed from the bucket the step holds at its worst (the largest parameter,
N = 700,000 elements, above the 1 MiB bucket limit): its gradients copied in the masters' dtype (4N
bytes, none on the plain path), Adam's denominator (4N), less the bucket's own 16-bit or fp32
gradients, freed once copied.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cost_models.errors import PlanInfeasible
from cost_models.memory import Optimizer, Precision, step_transient_bytes
from planner.plan import OffloadSpec, StateTier
from runtime.optim import optimizer_factory
from runtime.stage_optimizer import StageOptimizer

LARGEST = 700_000  # elements: above a 1 MiB bucket in fp32 and in 16 bits


def _allocated_peak_bytes(step: object) -> int:
    """The highest running sum of the CPU allocations and frees profiled while ``step()`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as run:
        step()  # type: ignore[operator]
    events = sorted((e for e in run.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize(("precision", "optimizer", "tier", "expected_bytes"), [
    ("fp32", "adam", "gpu", 4 * LARGEST),  # the parameters stepped in place: Adam's denominator only
    ("fp32", "momentum", "gpu", 0),  # SGD updates in place
    ("bf16", "adam", "gpu", 4 * LARGEST + 4 * LARGEST - 2 * LARGEST),  # fp32 copy, denominator, less bf16 grads
    ("bf16", "momentum", "gpu", 4 * LARGEST),  # the fp32 copy
    ("fp32", "adamw", "host", 4 * LARGEST + 4 * LARGEST - 4 * LARGEST),  # copy, denominator, less the grads
])
def test_a_step_allocates_what_the_cost_model_counts(precision: str, optimizer: str, tier: str,
                                                     expected_bytes: int) -> None:
    """On the CPU the device and the host are one memory: the host tier's step counts as on the device."""
    torch.manual_seed(0)
    mixed = Precision(precision).master_weights
    dtype = getattr(torch, Precision(precision).dtype)
    start = [torch.randn(shape) for shape in [(700, LARGEST // 700), *[(100, 500)] * 12, (300,)]]
    params = {f"p{i}": nn.Parameter(t.to(dtype)) for i, t in enumerate(start)}
    state = StageOptimizer(0, params, optimizer_factory(optimizer), spec=OffloadSpec(optimizer_state=StateTier(tier)),
                           device=torch.device("cpu"), sources=start if mixed else None)
    grad_bytes = sum(p.numel() * p.element_size() for p in params.values())

    def step() -> None:  # the gradients are made inside the profile, so their frees are seen
        for param in params.values():
            param.grad = torch.randn_like(param)
        state.step()

    step()  # the optimizer's state exists from the first step on
    measured = _allocated_peak_bytes(step) - grad_bytes
    assert measured == pytest.approx(expected_bytes, abs=64)
    assert step_transient_bytes(LARGEST, Precision(precision), Optimizer(optimizer),
                                separate_masters=not state.plain, steps_on_device=True) == expected_bytes


@pytest.mark.parametrize(("optimizer", "calls"), [
    ("momentum", 1),  # in place: nothing to bound, one step over every parameter
    ("sgd", 1),
    ("adam", 4),  # 1 MiB buckets: the largest alone, then 5 + 5 + 3 parameters of 200,000 bytes or less
])
def test_an_optimizer_stepping_in_place_steps_once_and_others_bucket_by_bucket(optimizer: str, calls: int) -> None:
    """The plain path's step: the same update as torch's optimizer stepping every parameter at once."""
    torch.manual_seed(0)
    start = [torch.randn(shape) for shape in [(700, LARGEST // 700), *[(100, 500)] * 12, (300,)]]
    params = {f"p{i}": nn.Parameter(t.clone()) for i, t in enumerate(start)}
    reference = [nn.Parameter(t.clone()) for t in start]
    state = StageOptimizer(0, params, optimizer_factory(optimizer), spec=OffloadSpec(), device=torch.device("cpu"))
    whole = optimizer_factory(optimizer)(reference)
    stepped = []
    real_step = state.optimizer.step
    state.optimizer.step = lambda: stepped.append(real_step())  # type: ignore[method-assign]
    for _ in range(2):
        grads = [torch.randn_like(t) for t in start]
        for param, mine, grad in zip(params.values(), reference, grads):
            param.grad, mine.grad = grad.clone(), grad.clone()
        state.step()
        whole.step()
    assert len(stepped) == 2 * calls
    for param, mine in zip(params.values(), reference):
        torch.testing.assert_close(param.detach(), mine.detach(), rtol=0, atol=0)


def test_a_plan_whose_peak_is_its_optimizer_step_predicts_it() -> None:
    """bf16 Adam on one GPU, one sample a micro-batch: the step's fp32 copy of the largest parameter (the
    token embedding) and Adam's denominator over it outgrow every activation. The plan's peak is then the
    model state (2 + 2 bytes of weight and gradient, 4 of master, 8 of Adam state a parameter) and 6 bytes
    an element of the embedding: the fp32 copy and the denominator (4 + 4) less its freed bf16 gradient (2)."""
    from examples.models.gpt import gpt
    from planner import plan

    with torch.device("meta"):
        model = gpt(vocab=8192, hidden=128, layers=2, heads=4, seq_len=16, dropout=0.0)
    largest = max(p.numel() for p in model.parameters())
    assert largest == 8192 * 128
    state_bytes = 16 * sum(p.numel() for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    made = plan(model, 1, state_bytes + 6 * largest, batch_size=1, example_inputs=torch.zeros((1, 16),
                dtype=torch.int64), device="A100-40GB", optimizer="adam", precision="bf16", reserve=0, offload=False)
    assert made.predicted.peak_mem_bytes == (state_bytes + 6 * largest,)
    assert made.stages[0].predicted.step_bytes > 0
    assert "memory of rank 0 (100% of the usable budget, at its optimizer step)" in str(made)
    with pytest.raises(PlanInfeasible, match="its peak is the optimizer step, which adds"):
        plan(model, 1, state_bytes + 6 * largest - 1, batch_size=1, example_inputs=torch.zeros((1, 16),
             dtype=torch.int64), device="A100-40GB", optimizer="adam", precision="bf16", reserve=0, offload=False)
