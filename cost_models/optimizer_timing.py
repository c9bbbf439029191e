"""Each optimizer's step timed on a device, as the runtime steps it (torch's own optimizer, then
``zero_grad``): a fixed time per parameter tensor and a time per parameter (OptimizerStepCost).

Two timings per optimizer: a step over many tiny tensors (its per-tensor cost alone: Python and op
launches, per tensor on the CPU's single-tensor path, amortised by the multi-tensor kernels on a GPU),
and a step over a model's mix of tensor sizes (the passes over their state, out of cache), less the
per-tensor part. The mix matters on the CPU: one 2 M-parameter tensor took Adam 4.4 ns a parameter
where the mix took 1.3, and a GPT's 53 tensors were predicted within 5% by the mix, 2.8x over by the one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from cost_models.device_spec import OptimizerStepCost

TINY_TENSORS = 200  # tiny tensors: a step over them is its per-tensor cost alone
CPU_MIX = tuple(2**(10 + k // 4) for k in range(40))  # 1 Ki..512 Ki parameters, 4.2 M in all
GPU_MIX = tuple(2**(14 + k // 4) for k in range(40))  # 16 Ki..8 Mi parameters, 67 M in all (1 GiB of Adam state)
_STEPS = 9  # timed steps per measurement (median), after the one that creates the state


def measure_optimizer_steps(device: Any, mix: Sequence[int], evict_bytes: int, *,
                            foreach: bool | None = None, names: Sequence[str] | None = None,
                            before: Callable[[], None] | None = None) -> dict[str, OptimizerStepCost]:
    """Per optimizer name, its step on ``device`` (a torch.device), from a cache that ``evict_bytes``
    written before each step have emptied (in a training step the backward has just evicted the state),
    after ``before`` (a layer's compute: on the CPU the step's per-tensor work, Python and small ops, costs
    1.4x as much after it as in a warm loop); ``foreach`` as the optimizer's option (None: torch's default
    for the device); ``names``: only these optimizers (default all)."""
    import torch

    from cost_models.memory import Optimizer

    evict = torch.empty(evict_bytes // 4, device=device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step_s(kind: Optimizer, shapes: Sequence[int]) -> float:
        params = [torch.nn.Parameter(torch.zeros(numel, device=device)) for numel in shapes]
        optimizer = kind.build(params, lr=1e-3)
        if foreach is not None:
            for group in optimizer.param_groups:
                group["foreach"] = foreach
        samples = []
        for _ in range(_STEPS + 1):
            for param in params:
                param.grad = torch.ones_like(param)
            if before is not None:
                before()
            evict.fill_(1.0)
            synchronize()
            start = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[1:])

    steps = {}
    for kind in Optimizer:
        if names is not None and kind.value not in names:
            continue
        per_tensor_s = step_s(kind, [16] * TINY_TENSORS) / TINY_TENSORS
        mix_s = step_s(kind, mix)
        per_param_s = max(mix_s - per_tensor_s * len(mix), 0.0) / sum(mix)
        steps[kind.value] = OptimizerStepCost(per_tensor_s * 1e6, per_param_s * 1e9)
    return steps


def measure_gradient_sums(mix: Sequence[int], evict_bytes: int) -> float:
    """Parameters per second a GPU's host adds the gradients each backward sends down into their sums, as the
    runtime adds them (runtime/stage_optimizer.py: ``total.add_(grad)`` in pinned memory where torch sees a
    GPU, one parameter at a time, in the masters' fp32), over a model's ``mix`` of tensor sizes, from a cache
    that ``evict_bytes`` written before each pass have emptied (the sums were last touched a micro-batch ago).
    The GPU waits meanwhile, so nothing else runs on those cores (on a CPU rank the sums run inside its own
    backward: see DeviceSpec.grad_sum_params_per_s)."""
    import torch

    def buffer(numel: int, value: float) -> torch.Tensor:
        made = torch.full((numel,), value)
        return made.pin_memory() if torch.cuda.is_available() else made

    totals, grads = [buffer(n, 0.0) for n in mix], [buffer(n, 1.0) for n in mix]
    evict = torch.empty(evict_bytes // 4)
    samples = []
    for _ in range(_STEPS + 1):
        evict.fill_(1.0)
        start = time.perf_counter()
        for total, grad in zip(totals, grads):
            total.add_(grad)
        samples.append(time.perf_counter() - start)
    return sum(mix) / max(statistics.median(samples[1:]), 1e-12)
