"""``tessera calibrate``: measure this machine's device into a device file ``--device`` accepts.

The presets carry datasheet peaks times efficiencies nobody measured on the user's machine. Calibrating
replaces them with what short micro-benchmarks achieve here:

* ``cpu``: cost_models/cpu_device.py's measurements (matmul per precision, copy bandwidth, per-op
  overhead, each optimizer's step, memory) on one intra-op thread, as a runtime CPU rank computes, and the link between two
  local gloo processes (latency, bandwidth), measured afresh (not the cache).
* ``cuda`` (or ``cuda:N``): the local GPU, starting from the preset that matches its name and memory:
  dense matmul TFLOP/s in fp64, fp32, tf32, fp16 and bf16, device-memory copy bandwidth, the launch
  overhead of a tiny kernel, the pinned host-to-device bandwidth and each optimizer's step (torch's
  multi-tensor kernels, per tensor and per parameter), each timed with the GPU synchronised; and the
  host's Adam step (parameters per second, ZeRO-Offload's step on the CPU) and its sums of gradients sent
  down each backward, on the cores one rank gets when every local GPU runs one (runtime/launch.py gives
  each CUDA rank that share). One GPU cannot measure the links between GPUs: those stay the preset's
  (said in the notes). The efficiencies become 1.0, since the peaks are achieved figures.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from cost_models.cpu_device import measure_cpu_device, measure_gloo_links, rank_threads
from cost_models.device_spec import BYTES_PER_GB, CALIBRATED, DeviceSpec
from cost_models.errors import InvalidArgument
from cost_models.optimizer_timing import GPU_MIX, measure_gradient_sums, measure_optimizer_steps

_REPEATS = 5
_MATMUL_SIZE = 4096  # large enough to reach a GPU's dense matmul peak
_COPY_BYTES = 512 * 2**20
_HOST_BYTES = 256 * 2**20
_EVICT_BYTES = 256 * 2**20  # larger than any GPU's L2 cache


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A measured device and what was not measured (kept from its starting point)."""

    device: DeviceSpec
    notes: tuple[str, ...]


def calibrate(device: str) -> Calibration:
    """Measure ``device`` ("cpu", "cuda" or "cuda:N") on this machine."""
    name = device.strip().lower()
    if name == "cpu":
        link, collective = measure_gloo_links()
        return Calibration(measure_cpu_device(threads=1, link=link, collective=collective),
                           ("cpu: one intra-op thread, as each CPU rank of the runtime; its ranks' link and "
                            "all-reduce are gloo between two local processes; NVMe is a documented default",))
    if name == "cuda" or name.startswith("cuda:"):
        return _calibrate_cuda(name)
    raise InvalidArgument(f"cannot calibrate device {device!r}; give cpu, cuda or cuda:N (a preset is a "
                          f"datasheet: calibrate the machine that has the device)")


def describe(calibration: Calibration) -> str:
    """The measured figures, one per line, then what was not measured."""
    spec = calibration.device
    rates = ", ".join(f"{label} {value:.3g}" for label, value in (
        ("fp64", spec.fp64_tflops), ("fp32", spec.fp32_tflops), ("tf32", spec.tf32_tflops),
        ("fp16", spec.fp16_tflops), ("bf16", spec.bf16_tflops)))
    lines = [f"device {spec.name}: {spec.mem_bytes / 2**30:.1f} GiB",
             f"matmul TFLOP/s: {rates}",
             f"memory copy bandwidth: {spec.mem_bandwidth_gb_per_s:.1f} GB/s; per-op overhead "
             f"{spec.kernel_overhead_us:.2f} us",
             f"host link: {spec.host_link.bandwidth_gb_per_s:.1f} GB/s ({spec.host_link.name})",
             f"between ranks: {spec.intra_node.bandwidth_gb_per_s:.2f} GB/s, {spec.intra_node.latency_us:.0f} us "
             f"({spec.intra_node.name})"]
    if spec.optimizer_steps:
        lines.append("optimizer step: " + ", ".join(f"{name} {cost.us_per_tensor:.1f} us/tensor + "
                                                      f"{cost.ns_per_param:.3g} ns/param"
                                                      for name, cost in spec.optimizer_steps))
    lines.append(f"host tier's optimizer step: {spec.host_optimizer_params_per_s / 1e6:.0f} M params/s; "
                 f"gradients summed on the host: {spec.grad_sum_params_per_s() / 1e6:.0f} M params/s")
    if spec.collective_link is not None:
        collective = spec.collective_link
        lines.append(f"all-reduce as a ring over: {collective.bandwidth_gb_per_s:.2f} GB/s, "
                     f"{collective.latency_us:.0f} us ({collective.name})")
    return "\n".join(lines + [f"note: {note}" for note in calibration.notes])


def _calibrate_cuda(name: str) -> Calibration:
    import torch

    from cost_models.profiling import _preset_for_local_gpu

    if not torch.cuda.is_available():
        raise InvalidArgument(f"cannot calibrate {name!r}: torch sees no CUDA device on this machine "
                              f"(torch {torch.__version__}); run it where the GPU is, or calibrate cpu")
    device = torch.device(name)
    base = _preset_for_local_gpu(device)
    properties = torch.cuda.get_device_properties(device)
    with torch.cuda.device(device):
        rates = {dtype: _matmul_tflops(device, dtype) for dtype in ("fp64", "fp32", "tf32", "fp16", "bf16")}
        adam_params_per_s, sum_params_per_s = _host_rates(torch.cuda.device_count())
        measured = dataclasses.replace(
            base, name=base.name + CALIBRATED, mem_bytes=int(properties.total_memory),
            fp64_tflops=rates["fp64"], fp32_tflops=rates["fp32"], tf32_tflops=rates["tf32"],
            fp16_tflops=rates["fp16"], bf16_tflops=rates["bf16"],
            mem_bandwidth_gb_per_s=_copy_gb_per_s(device), kernel_overhead_us=_launch_us(device),
            host_link=dataclasses.replace(base.host_link, name="pinned host to device (measured)",
                                          bandwidth_gb_per_s=_host_gb_per_s(device)),
            matmul_efficiency=1.0, memory_efficiency=1.0,
            optimizer_steps=measure_optimizer_steps(device, GPU_MIX, _EVICT_BYTES),
            host_optimizer_params_per_s=adam_params_per_s, host_grad_sum_params_per_s=sum_params_per_s)
    return Calibration(measured, (f"{properties.name}: started from preset {base.name}; its links between GPUs "
                                  f"({base.intra_node.name}, {base.inter_node.name}) are the preset's: one GPU "
                                  f"cannot measure them", "host link latency and NVMe are the preset's"))


def _host_rates(gpus: int) -> tuple[float, float]:
    """Parameters per second the host's Adam step updates (torch's multi-tensor step, as the runtime's host
    tier runs it) and that it adds gradients into their sums (pinned, as ZeRO-Offload's gradients arrive each
    backward), on the cores of one of ``gpus`` local ranks, over a GPU model's tensor sizes: on an H100's host
    (16 cores) the CPU mix's small tensors gave 448 M/s where a GPT's 418 M parameters stepped at about
    1000 M/s."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(rank_threads(gpus))
    try:
        adam = measure_optimizer_steps(torch.device("cpu"), GPU_MIX, _EVICT_BYTES, foreach=True,
                                       names=("adam",))["adam"]
        sums = measure_gradient_sums(GPU_MIX, _EVICT_BYTES)
    finally:
        torch.set_num_threads(previous)
    return adam.params_per_s(GPU_MIX), sums


def _cuda_seconds(device: Any, work: Callable[[], object]) -> float:
    """Median seconds of ``work`` on ``device`` after one warm-up, the GPU synchronised around each run."""
    import torch

    work()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(_REPEATS):
        start = time.perf_counter()
        work()
        torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return max(statistics.median(samples), 1e-9)


def _matmul_tflops(device: Any, precision: str) -> float:
    """Dense matmul TFLOP/s in ``precision`` (tf32: fp32 inputs on TF32 tensor cores), 0 where unsupported."""
    import torch

    dtype = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
             "bf16": torch.bfloat16}[precision]
    size = _MATMUL_SIZE // 2 if precision == "fp64" else _MATMUL_SIZE
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        seconds = _cuda_seconds(device, lambda: torch.matmul(a, b))
        return 2.0 * size**3 / seconds / 1e12
    except RuntimeError:
        return 0.0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _copy_gb_per_s(device: Any) -> float:
    """Device-memory copy bandwidth (bytes read plus written), GB/s."""
    import torch

    src = torch.ones(_COPY_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2.0 * _COPY_BYTES / _cuda_seconds(device, lambda: dst.copy_(src)) / BYTES_PER_GB


def _launch_us(device: Any) -> float:
    """Wall time per tiny kernel (a 1-element add), launched back to back, microseconds."""
    import torch

    a = torch.ones(1, device=device)
    out = torch.empty_like(a)
    calls = 1000

    def launches() -> None:
        for _ in range(calls):
            torch.add(a, a, out=out)
    return _cuda_seconds(device, launches) / calls * 1e6


def _host_gb_per_s(device: Any) -> float:
    """Pinned host-to-device copy bandwidth, GB/s."""
    import torch

    host = torch.ones(_HOST_BYTES // 4, dtype=torch.float32).pin_memory()
    target = torch.empty_like(host, device=device)
    return _HOST_BYTES / _cuda_seconds(device, lambda: target.copy_(host, non_blocking=True)) / BYTES_PER_GB
