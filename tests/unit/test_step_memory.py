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

from cost_models.allocations import allocated_peak_bytes
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
    return allocated_peak_bytes(run)


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
    assert ("memory of rank 0 (100% of the usable budget as the search bounds it, 100% at its predicted peak, "
            "at its optimizer step)") in str(made)
    with pytest.raises(PlanInfeasible, match="its peak is the optimizer step, which adds"):
        plan(model, 1, state_bytes + 6 * largest - 1, batch_size=1, example_inputs=torch.zeros((1, 16),
             dtype=torch.int64), device="A100-40GB", optimizer="adam", precision="bf16", reserve=0, offload=False)


class _OutOfOrder(nn.Module):
    """Uses its modules in another order than it defines them, and a parameter through ``get_attr``
    (a module's own parameter, registered before that module's submodules), so the order the runtime steps
    a stage's parameters in is torch.fx's registration order, not the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        self.early = nn.Linear(32, 64)
        self.scale = nn.Parameter(torch.ones(64))
        self.late.gain = nn.Parameter(torch.ones(64))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.late[1](self.early(x)) * self.scale
        x = self.late[0](x) * self.late.gain
        return self.head(torch.relu(x)).sum(dim=-1)


def _runtime_stages(made: object, model: nn.Module) -> dict[int, object]:
    """Each part's stage as its rank builds it (runtime/setup.py, one stage a rank, no process group)."""
    from runtime import build
    from runtime.dataflow import dataflow
    from runtime.stages import local_stages
    from runtime.values import value_specs

    traced = build.trace_checked(model, made)
    modules = build.split_stages(traced, model, made)
    inputs = [(meta.shape, getattr(torch, meta.dtype)) for meta in made.model.example_inputs]
    flow = dataflow(traced, modules, made.part_of(), value_specs(traced, inputs, made.training.micro_batch_size))
    return {part: local_stages(model, modules, flow, {part: part})[part] for part in range(made.num_parts)}


def _models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    from examples.models.gpt import gpt
    from examples.models.resnet import resnet50
    from examples.models.unet import unet_small

    return {"gpt, tied": (gpt(vocab=512, hidden=64, layers=4, heads=4, seq_len=16, dropout=0.0, device="cpu"),
                          torch.zeros((2, 16), dtype=torch.int64)),
            "resnet": (resnet50(width=8, num_classes=10), torch.zeros((2, 3, 32, 32))),
            "unet": (unet_small(), torch.zeros((2, 3, 32, 32))),
            "out of order": (_OutOfOrder(), torch.zeros((2, 32)))}


@pytest.mark.parametrize("name", list(_models()))
@pytest.mark.parametrize("stages", [2, 3])
def test_the_planner_lists_a_stages_parameters_in_the_order_the_runtime_steps_them(name: str, stages: int) -> None:
    """planner/stepped.py's order (which packs the step's buckets) against the stage's parameters as the
    runtime builds and steps them, every cut the search may choose: the plan's."""
    from planner import plan, trace
    from planner.stepped import module_order

    torch.manual_seed(0)
    model, example = _models()[name]
    made = plan(model, stages, "40GB", batch_size=2, example_inputs=example, device="A100-40GB", num_stages=[stages],
                offload=False, spatial=False, optimizer="momentum")
    graph = trace(model, example)
    built = _runtime_stages(made, model)
    for part, stage in built.items():
        assert module_order(graph, made.stages[part].nodes) == tuple(stage.params), f"stage {part}"


def test_a_plans_step_peak_is_its_stages_buckets_as_the_runtime_packs_them() -> None:
    """bf16 Adam, one sample a micro-batch, two stages of a GPT whose parameters are each below the 1 MiB
    bucket limit (in bf16, 524,288 elements) but add up to more per stage: the runtime packs a stage's
    parameters into buckets up to the limit, so its worst bucket holds less than the limit. Each rank's
    predicted peak is its step's: its model state (16 bytes a parameter, and its buffers) and what a step of
    its parameters, built and stepped as the runtime does, is measured to allocate."""
    from examples.models.gpt import gpt
    from planner import plan

    torch.manual_seed(0)
    model = gpt(vocab=2048, hidden=128, layers=4, heads=4, seq_len=8, dropout=0.0, tie_embeddings=False,
                device="cpu")
    example = torch.zeros((1, 8), dtype=torch.int64)
    made = plan(model, 2, "40GB", batch_size=4, example_inputs=example, device="A100-40GB", optimizer="adam",
                precision="bf16", num_stages=[2], micro_batch_sizes=[1], schedules=["1f1b"], offload=False,
                spatial=False)
    for part, stage in _runtime_stages(made, model).items():
        start = [param.detach().clone() for param in stage.params.values()]
        params = {name: nn.Parameter(param.to(torch.bfloat16)) for name, param in zip(stage.params, start)}
        state = StageOptimizer(part, params, optimizer_factory("adam"), spec=OffloadSpec(),
                               device=torch.device("cpu"), sources=start)
        grad_bytes = sum(p.numel() * p.element_size() for p in params.values())

        def step(params: dict[str, nn.Parameter] = params, state: StageOptimizer = state) -> None:
            for param in params.values():
                param.grad = torch.randn_like(param)
            state.step()

        step()
        measured = _allocated_peak_bytes(step) - grad_bytes
        assert measured < 6 * (2**20 // 2)  # below a bucket at the limit: what the search bounds it by
        buffers = sum(b.nbytes for b in stage.module.buffers())
        state_bytes = 16 * sum(p.numel() for p in params.values()) + buffers
        assert made.predicted.peak_mem_bytes[part] == pytest.approx(state_bytes + measured, abs=64), f"stage {part}"


def test_gradients_sent_to_the_host_leave_the_parameters_after_each_backward_and_step_as_their_sum() -> None:
    """grads_on_host: after each backward no parameter holds a gradient; the host's step then equals SGD on the
    sum of the backwards' gradients (a copy of the model trained plainly)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    reference = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    reference.load_state_dict(model.state_dict())
    spec = OffloadSpec(optimizer_state=StateTier.HOST, grads_on_host=True)
    state = StageOptimizer(0, dict(model.named_parameters()), optimizer_factory("momentum", 0.1), spec=spec,
                           device=torch.device("cpu"))
    batches = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    for x in batches:
        model(x).square().sum().backward()
        assert all(param.grad is None for param in model.parameters())
    state.step()
    for x in batches:
        reference(x).square().sum().backward()
    plain = optimizer_factory("momentum", 0.1)(list(reference.parameters()))
    plain.step()
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-12, atol=0, msg=name)
    assert state.gradients() == []  # the sums were taken by the step
