"""On one CUDA device: the executor's CUDA path (compute and side streams ordered by events).

NCCL cannot put two ranks on one GPU, so these tests run one process: several stages on one
rank (handed over in memory) against the CPU float64 reference (memory tiers and gradients sent to
the host too), the gradient all-reduce on its side stream right after a long kernel on the compute
stream, and the allocator's peak.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from planner.plan import OffloadSpec, Plan, StateTier
from runtime.build import rebuild_model
from runtime.executor import Executor
from runtime.grads import GradientSync
from runtime.optim import optimizer_factory
from tests.dist.runtime_cases import Case, check_outcomes, reference, run_cases
from tests.dist.test_runtime import GPT_ATTENTION_1, GPT_MLP_0, RESNET_RESIDUAL_2_0, RESNET_STEM
from tests.runtime_plans import GPT, RESNET, looped, make_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# cuDNN's and cuBLAS's float64 kernels sum in another order than the CPU's: an H200 differed from the CPU
# reference by up to 8.3e-10 in a ResNet gradient of 1.5e-2 (rounding; a wrong result is off by far more)
GPU_RTOL, GPU_ATOL = 1e-6, 1e-8


@pytest.fixture(scope="module")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    torch.cuda.set_device(0)
    init = tmp_path_factory.mktemp("nccl") / "rendezvous"
    dist.init_process_group("nccl", init_method=f"file://{Path(init)}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_stages_on_one_gpu_equal_the_cpu_reference(nccl: None) -> None:
    cases = [Case(looped(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b"), ranks=1)),
             Case(looped(make_plan(RESNET, ["layer2_0_conv2", "layer2_0_conv3"], schedule="gpipe"), ranks=1))]
    for case, outcome in zip(cases, run_cases(0, 1, cases)):
        check_outcomes(reference(case), case, [outcome], rtol=GPU_RTOL, atol=GPU_ATOL)


def test_memory_tiers_on_one_gpu_equal_the_cpu_reference(nccl: None) -> None:
    """Swapped activations through pinned host memory on the copy stream, checkpoint regions, master
    weights and optimizer state on the host: the same losses and gradients as the float64 reference on
    the CPU."""
    gpt = [OffloadSpec(recompute=(GPT_MLP_0,), swap=("blocks_0_attn_qkv", "blocks_0_mlp_proj"),
                       optimizer_state=StateTier.HOST),
           OffloadSpec(recompute=(GPT_ATTENTION_1,), swap=("blocks_1_mlp_fc", "blocks_1_mlp_gelu", "linear"))]
    resnet = [OffloadSpec(recompute=(RESNET_STEM,), swap=("layer1_0_conv1", "layer1_0_bn1")),
              OffloadSpec(recompute=(("layer2_0_conv2", "layer2_0_bn2", "layer2_0_relu2"),),
                          swap=RESNET_RESIDUAL_2_0, optimizer_state=StateTier.HOST)]
    cases = [Case(looped(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", offload=gpt), ranks=1)),
             Case(looped(make_plan(RESNET, ["layer2_0_conv2"], schedule="gpipe", offload=resnet), ranks=1))]
    for case, outcome in zip(cases, run_cases(0, 1, cases)):
        check_outcomes(reference(case), case, [outcome], rtol=GPU_RTOL, atol=GPU_ATOL)
        assert outcome.swapped_bytes > 0 and outcome.checkpointed == 2


def test_gradients_sent_to_the_host_each_backward_on_one_gpu_equal_the_cpu_reference(nccl: None) -> None:
    """ZeRO-Offload's gradients from a GPU (``grads_on_host``): each backward's cast on the device, copied into
    pinned host memory and summed there by the post-accumulate-grad hooks, the host's Adam reading the sums; the
    tied embedding (both stages on this rank) keeps its gradient on the GPU for its sum across stages."""
    sent = OffloadSpec(optimizer_state=StateTier.HOST, grads_on_host=True)
    cases = [Case(looped(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", optimizer="adam", offload=[sent, sent]),
                         ranks=1), lr=1e-3),
             Case(looped(make_plan(RESNET, ["layer2_0_conv2"], schedule="gpipe", offload=[sent, OffloadSpec()]),
                         ranks=1))]
    for case, outcome in zip(cases, run_cases(0, 1, cases)):
        check_outcomes(reference(case), case, [outcome], rtol=GPU_RTOL, atol=GPU_ATOL)


def test_the_all_reduce_stream_waits_for_the_compute_stream(nccl: None) -> None:
    sync = GradientSync(torch.device("cuda", 0), timeout_s=60, bucket_bytes=2**20)
    params = [torch.nn.Parameter(torch.zeros(512, 512, device="cuda")) for _ in range(3)]
    big = torch.randn(4096, 4096, device="cuda")
    for param in params:  # long kernels queued on the compute stream right before the reduce
        param.grad = (big @ big)[:512, :512].contiguous()
    expected = [p.grad.clone() for p in params]
    sync.all_reduce(params, dist.group.WORLD, "test")
    for param, want in zip(params, expected):
        torch.testing.assert_close(param.grad, want)


def test_the_peak_is_the_allocators(nccl: None) -> None:
    plan = Plan.from_dict(json.loads(looped(make_plan(GPT, ["blocks_1_ln_1"], schedule="gpipe"), ranks=1)))
    exe = Executor(plan, rebuild_model(plan), lambda out, target: out.float().pow(2).mean(),
                   optimizer_factory("momentum", 0.01))
    tokens = torch.randint(0, 512, (plan.training.global_batch_size, 32))
    exe.step(tokens, None)
    assert exe.memory.peak_bytes == torch.cuda.max_memory_allocated() > 0
    assert all(p.device.type == "cuda" for stage in exe.stages.values() for p in stage.params.values())
