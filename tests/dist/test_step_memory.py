"""ZeRO-1's optimizer step on 2 gloo ranks allocates what cost_models/memory.py counts: each bucket's shards
are stepped and then all-gathered on their own, so the step holds one bucket's gathered weights, not the
stage's (runtime/stage_optimizer.py).

Hand-computed reference, for the largest parameter (N = 1,400,000 elements, n = N / 2 per rank: a bucket of
its own, above 1 MiB in fp32 and bf16): stepping it copies its shard of gradient into the masters' dtype (4n
bytes) and frees the whole gradient the shard is a view of (N = 2n elements); the all-gather holds both
ranks' shards (2n elements) twice (gloo gathers into a buffer of its own first) and this rank's row (n) in
the weights' dtype, and in bf16 the fp32 masters cast first (n).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cost_models.comm import ALL_GATHER_STAGING
from cost_models.memory import Optimizer, Precision, step_transient_bytes, zero_gather_bytes
from planner.plan import OffloadSpec
from runtime.optim import optimizer_factory
from runtime.sharding import ShardGroup
from runtime.stage_optimizer import StageOptimizer
from tests.dist.harness import run_ranks
from tests.unit.test_step_memory import _allocated_peak_bytes

LARGEST = 1_400_000

pytestmark = pytest.mark.dist


def _zero1_step(rank: int, world_size: int, precision: str) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    dtype = getattr(torch, Precision(precision).dtype)
    start = [torch.randn(shape) for shape in [(1400, LARGEST // 1400), *[(100, 500)] * 12, (300,)]]
    params = {f"p{i}": nn.Parameter(t.to(dtype)) for i, t in enumerate(start)}
    state = StageOptimizer(0, params, optimizer_factory("adam"), spec=OffloadSpec(zero_stage=1),
                           device=torch.device("cpu"), shards=ShardGroup(dist.group.WORLD, timeout_s=60),
                           sources=start if Precision(precision).master_weights else None)
    generator = torch.Generator().manual_seed(1)  # the same gradients on both ranks (as after an all-reduce)

    def step() -> None:
        for param in params.values():
            param.grad = torch.randn(param.shape, generator=generator).to(dtype)
        state.step()

    step()
    measured = _allocated_peak_bytes(step) - sum(p.numel() * p.element_size() for p in params.values())
    return measured, [p.detach().clone() for p in params.values()]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero1_steps_and_gathers_one_bucket_at_a_time(precision: str) -> None:
    outcomes = run_ranks(_zero1_step, 2, precision, timeout_s=120)
    shard = LARGEST // 2
    expected = {"fp32": 4 * (2 * 2 * shard + shard - 2 * shard),  # the gather (2 x 2n + n) less the gradient
                "bf16": 2 * (2 * 2 * shard + shard + shard - 2 * shard)}[precision]  # and the cast (n)
    for measured, _ in outcomes:
        assert measured == pytest.approx(expected, abs=64)
    kind = Precision(precision)
    assert max(step_transient_bytes(shard, kind, Optimizer.ADAM, separate_masters=True, steps_on_device=True,
                                    freed_numel=LARGEST),
               zero_gather_bytes(shard, kind, 2, masters_off_device=False, freed_numel=LARGEST,
                                 staging=ALL_GATHER_STAGING["gloo"])) == expected
    for mine, theirs in zip(outcomes[0][1], outcomes[1][1]):  # every replica gathered the same weights
        assert torch.equal(mine, theirs)


def _profiled_peak(rank: int, world_size: int, plan_json: str) -> int:
    """The runtime's measured peak (runtime/memory.py: the profiled allocations of the third step)."""
    from runtime.microbatch import split_batch
    from tests.dist.runtime_cases import Case, _executor

    exe, data = _executor(plan_json, Case(plan_json), None)
    training = exe.plan.training
    for step in range(3):
        batch = data.samples(step, 0, training.global_batch_size)
        exe.run(split_batch(batch.inputs, batch.targets, global_batch_size=training.global_batch_size,
                            data_parallel=1, replica=0, num_microbatches=training.num_microbatches),
                profile_memory=step == 2)
    return exe.memory.peak_bytes


def test_tied_weights_on_one_stage_peak_as_predicted() -> None:
    """GPT's token embedding is also its output head: on one stage, autograd holds both uses' partial
    gradients and their sum at once (the embedding's backward), which the plan's peak counts."""
    from planner.plan import Plan
    from tests.runtime_plans import GPT, make_plan

    for micro_batch_size, microbatches in ((1, 1), (2, 2)):  # without the sum, the first is 16% below
        plan_json = make_plan(GPT, [], schedule="gpipe", microbatches=microbatches,
                              micro_batch_size=micro_batch_size)
        predicted = Plan.from_dict(json.loads(plan_json)).predicted.peak_mem_bytes[0]
        measured = run_ranks(_profiled_peak, 1, plan_json, timeout_s=120)[0]
        assert measured == pytest.approx(predicted, rel=0.05), (micro_batch_size, microbatches)


def test_a_backward_adding_into_the_gradients_peaks_as_predicted() -> None:
    """An untied GPT whose output head (16,384 x 128) dwarfs one sample's activations, two micro-batches a
    step: the second backward computes the head's weight gradient (16 MiB in fp64) before adding it into
    the one the first made. The plan's peak counts it (11% below the measured peak without it)."""
    from cost_models.graph.model_spec import build_model, load_builder
    from planner.manual import plan_with_split
    from planner.plan import Plan
    from tests.runtime_plans import default_dtype

    builder = "examples/models/gpt.py:gpt"
    kwargs = {"vocab": 16384, "hidden": 128, "layers": 2, "heads": 4, "seq_len": 8, "dropout": 0.0,
              "tie_embeddings": False}
    with default_dtype(torch.float64):
        model = build_model(load_builder(builder), kwargs, "meta")
        plan_json = plan_with_split(model, example_inputs=torch.empty(1, 8, dtype=torch.long, device="meta"),
                                    stage_starts=[], batch_size=2, micro_batch_size=1, data_parallel=1,
                                    schedule="gpipe", device="V100-16GB", optimizer="momentum", precision="fp64",
                                    builder=builder, builder_kwargs=kwargs).to_json()
    plan = Plan.from_dict(json.loads(plan_json))
    assert plan.stages[0].predicted.accumulate_bytes > 0
    measured = run_ranks(_profiled_peak, 1, plan_json, timeout_s=120)[0]
    assert measured == pytest.approx(plan.predicted.peak_mem_bytes[0], rel=0.05)


def test_a_host_tier_plan_on_a_cpu_rank_measures_its_device_memory() -> None:
    """A CPU rank holds the host tier's fp32 masters and Adam state in the same memory as its stage, but they
    are the plan's host memory (``host_bytes``), not its device memory: the measured peak leaves them out, as
    the CUDA allocator does on a GPU (counting them measured 41% above the prediction; now -2.9%)."""
    from planner.plan import Plan, StateTier
    from tests.runtime_plans import GPT, searched_plan

    plan_json = searched_plan(GPT, gpus=1, budget_share=0.8, offload=("host",), optimizer="adam", batch_size=8,
                              micro_batch_size=2)
    plan = Plan.from_dict(json.loads(plan_json))
    assert {stage.offload.optimizer_state for stage in plan.stages} == {StateTier.HOST}
    measured = run_ranks(_profiled_peak, 1, plan_json, timeout_s=120)[0]
    assert measured == pytest.approx(plan.predicted.peak_mem_bytes[0], rel=0.05)
