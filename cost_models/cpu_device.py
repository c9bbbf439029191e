"""The "cpu" device: measured on this machine with short torch micro-benchmarks, not guessed."""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cost_models.device_spec import BYTES_PER_GB, DeviceSpec, LinkSpec
from cost_models.errors import InvalidArgument
from cost_models.host_allocator import keep_freed_memory
from cost_models.optimizer_timing import CPU_MIX, measure_optimizer_steps
from cost_models.presets import NVME_GEN3_X4

CPU_NAME = "cpu"


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rank_threads(local_ranks: int) -> int:
    """Intra-op threads of one of ``local_ranks`` GPU ranks on this machine: its share of the cores."""
    return max(1, usable_cores() // max(1, local_ranks))

# --------------------------------------------------------------------------------------------
# Measured CPU device.
# --------------------------------------------------------------------------------------------

_MATMUL_BUDGET_S = 0.12  # wall-clock budget per precision; four precisions stay well under 1 s
_MATMUL_MAX_SIZE = 512
_MATMUL_MIN_SIZE = 64
_COPY_MAX_BYTES = 128 * 2**20  # large enough to spill most last-level caches
_REPEATS = 3


def _median_seconds(run: Callable[[], object], *, repeats: int, budget_s: float) -> float:
    """Median wall time of `run` after one warm-up, stopping early once `budget_s` is spent."""
    run()  # warm-up: first-call allocation, page faults, kernel selection
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < repeats:
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return max(statistics.median(samples), 1e-9)


def _matmul_tflops(dtype: Any) -> float:
    """Measured CPU matmul TFLOP/s in `dtype`, or 0.0 if torch cannot run it on the CPU."""
    import torch

    def rate(size: int, budget_s: float) -> float:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        out = torch.empty(size, size, dtype=dtype)
        seconds = _median_seconds(lambda: torch.matmul(a, b, out=out), repeats=_REPEATS, budget_s=budget_s)
        return 2.0 * size**3 / seconds

    try:
        # A small probe sizes the real run so slow (emulated) precisions stay inside the budget.
        probe_flops_per_s = rate(_MATMUL_MIN_SIZE * 2, budget_s=_MATMUL_BUDGET_S / 4)
        per_run_s = _MATMUL_BUDGET_S / (_REPEATS + 1)
        size = int((probe_flops_per_s * per_run_s / 2.0) ** (1.0 / 3.0)) // 64 * 64
        size = min(_MATMUL_MAX_SIZE, max(_MATMUL_MIN_SIZE, size))
        return rate(size, budget_s=_MATMUL_BUDGET_S) / 1e12
    except (RuntimeError, TypeError, NotImplementedError):
        return 0.0


def _copy_bandwidth_gb_per_s(mem_bytes: int) -> float:
    """Measured copy bandwidth (bytes read + bytes written, as STREAM "Copy" counts) in GB/s."""
    import torch

    nbytes = min(_COPY_MAX_BYTES, max(2**20, mem_bytes // 16))
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), repeats=_REPEATS, budget_s=0.15)
    return 2.0 * src.numel() * src.element_size() / seconds / BYTES_PER_GB


def _op_overhead_us() -> float:
    """Measured wall time of one tiny op (torch.add on 1-element tensors), in microseconds."""
    import torch

    a = torch.ones(1)
    b = torch.ones(1)
    out = torch.empty(1)
    calls = 500

    def batch() -> None:
        for _ in range(calls):
            torch.add(a, b, out=out)

    return _median_seconds(batch, repeats=_REPEATS, budget_s=0.05) / calls * 1e6


_PING_BYTES = 4 * 2**10  # small enough that its round trip is latency
_STREAM_BYTES = 16 * 2**20  # large enough that its round trip is bandwidth
_STREAM_PIECES = 16  # the large all-reduce's gradients: a bucket of 1 MiB tensors
_GLOO_TIMEOUT_S = 60
_BUSY_MATMUL = 256  # six matmuls of this size (about 2 ms) and a pass over _BUSY_SWEEP_BYTES: the core and
_BUSY_SWEEP_BYTES = 4 * 2**20  # its caches as a layer's compute leaves them to a post or a step after it


def _layer_compute() -> Callable[[], None]:
    """Work that leaves the core and its caches as a layer's compute does: six 256x256 matmuls (about 2 ms)
    and a pass over 4 MiB. The calibrations of what a step does between layers (posting a message, the
    optimizer's step) run it before each timing: after it, such Python-heavy work took 1.4x (an optimizer
    step's per-tensor cost) to 3-4x (a post) what it takes in a warm loop."""
    import torch

    weights = torch.randn(_BUSY_MATMUL, _BUSY_MATMUL)
    sweep = torch.randn(_BUSY_SWEEP_BYTES // 4)

    def compute() -> None:
        for _ in range(6):
            torch.tanh(weights @ weights)
        torch.relu(sweep)
    return compute


def rank_cores(cores: Sequence[int], local_rank: int, local_world_size: int) -> tuple[int, ...] | None:
    """The share of ``cores`` (sorted) that local rank ``local_rank`` of ``local_world_size`` runs on: an equal
    run of consecutive cores each; None where there are fewer cores than ranks (nothing is bound).

    >>> rank_cores(range(16), 2, 4), rank_cores(range(2), 1, 2), rank_cores(range(2), 0, 3)
    ((8, 9, 10, 11), (1,), None)
    """
    share = len(cores) // local_world_size if local_world_size > 0 else 0
    if share < 1 or not 0 <= local_rank < local_world_size:
        return None
    return tuple(sorted(cores)[local_rank * share:(local_rank + 1) * share])


def pin_cpu_rank(local_rank: int, local_world_size: int) -> frozenset[int]:
    """Bind this CPU rank (and the threads it starts later: gloo's) to its own share of the cores it may
    use (:func:`rank_cores`), when every local rank can have at least one: a rank's compute then stays on its
    cores and its communication threads are not moved between cores; with more ranks than cores nothing is
    bound (the scheduler shares the cores). The runtime's CPU ranks are bound so, and so are the two
    processes that measure gloo for them (:func:`measure_gloo_links`) and the profile's copies training
    beside it (cost_models.profiling.co_running). Returns the cores it runs on.

    >>> cores = sorted(os.sched_getaffinity(0))
    >>> pin_cpu_rank(0, len(cores) + 1) == frozenset(cores)  # more ranks than cores: unchanged
    True
    """
    if not hasattr(os, "sched_setaffinity"):  # an OS without CPU affinity (macOS): nothing to bind
        return frozenset(range(os.cpu_count() or 1))
    share = rank_cores(sorted(os.sched_getaffinity(0)), local_rank, local_world_size)
    if share is not None:
        os.sched_setaffinity(0, share)
    return frozenset(os.sched_getaffinity(0))


def settle_cpu_rank(local_rank: int, local_ranks: int) -> None:
    """A CPU rank's process as the runtime starts it (runtime/launch.py), and the processes that measure
    gloo for it: bound to its share of the cores (:func:`pin_cpu_rank`) and keeping the memory it frees
    for its next step (cost_models/host_allocator.py)."""
    pin_cpu_rank(local_rank, local_ranks)
    keep_freed_memory()


def measure_gloo_links() -> tuple[LinkSpec, LinkSpec]:
    """Two processes of this machine talking through gloo (TCP loopback), as the runtime's CPU ranks do:

    * point to point: the latency is half a small message's round trip, the bandwidth what a large one's
      adds beyond it; posting a message costs the posting rank's own core time (``post_us``: gloo's
      ``isend``/``irecv`` calls, measured as the runtime posts them: receives ahead, sends after compute);
    * all-reduce: the link a two-rank ring all-reduce behaves as (its time is 2 alpha + bytes / beta,
      cost_models.comm): each of its two steps a message's latency (a small all-reduce between idle ranks
      is no steadier a measure: on a 2-core VM ten in a row took 0.3-0.4 ms in some seconds and 3-3.5 ms in
      others), its bandwidth what a large all-reduce adds beyond them, run as the runtime sums a bucket of
      gradients after a backward; gloo's all-reduce also sums on the CPU, so it is slower than its
      messages alone.

    Two fresh interpreters (``python -m cost_models.cpu_device``, so nothing re-imports the caller's
    script), a few seconds, most of it their start."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as scratch:
        store = str(Path(scratch) / "store")
        command = [sys.executable, "-m", "cost_models.cpu_device"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        ranks = [subprocess.Popen([*command, str(rank), store], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for rank in range(2)]
        outputs = []
        for process in ranks:
            try:
                outputs.append(process.communicate(timeout=_GLOO_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                for each in ranks:
                    each.kill()
                outputs.append(("", "timed out"))
        failed = [(process.returncode, err.strip().splitlines()[-1:] or [""])
                  for process, (_, err) in zip(ranks, outputs) if process.returncode != 0]
    if failed:
        raise InvalidArgument(f"measuring gloo between two local processes failed ({failed[0][1][0][:200]}); "
                              f"describe the CPU as a JSON device file instead (see DeviceSpec.to_dict)")
    ping_s, stream_s, large_sum_s, post_s = (float(value) for value in outputs[0][0].split())
    latency_s = ping_s / 2
    per_byte_s = max(stream_s / 2 - latency_s, 1e-9) / _STREAM_BYTES
    # a two-rank ring: 2 (n - 1) = 2 steps, each a message's latency; 2 (n - 1) / n = 1 pass over the bytes
    sum_per_byte_s = max(large_sum_s - 2 * latency_s, 1e-9) / _STREAM_BYTES
    return (LinkSpec(name="gloo TCP loopback (measured)", bandwidth_gb_per_s=1 / per_byte_s / BYTES_PER_GB,
                     latency_us=latency_s * 1e6, post_us=post_s * 1e6),
            LinkSpec(name="gloo all-reduce on TCP loopback (measured)",
                     bandwidth_gb_per_s=1 / sum_per_byte_s / BYTES_PER_GB, latency_us=latency_s * 1e6))


def _ping_pong(rank: int, store_path: str) -> tuple[float, float, float, float]:
    """One of the two processes of :func:`measure_gloo_links`: median round trips of a small and a large
    message, the median time of a large all-reduce as the runtime runs one, and what posting a message costs."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    settle_cpu_rank(rank, 2)  # as the runtime starts its ranks: gloo's threads share the rank's core
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=_GLOO_TIMEOUT_S))

    def round_trip_s(nbytes: int, repeats: int) -> float:
        message = torch.zeros(nbytes // 4)
        samples = []
        for _ in range(repeats + 1):  # the first warms the connection up
            dist.barrier()
            start = time.perf_counter()
            for sending in ((True, False) if rank == 0 else (False, True)):  # as the runtime posts them:
                op = dist.isend if sending else dist.irecv  # one batch_isend_irecv per run, then a wait
                for work in dist.batch_isend_irecv([dist.P2POp(op, message, 1 - rank)]):
                    work.wait()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[1:])

    def bucket_all_reduce_s(nbytes: int, pieces: int, repeats: int) -> float:
        """A large all-reduce as the runtime sums a bucket of gradients (runtime/grads.py): ``pieces``
        tensors flattened into a new buffer, summed and copied back, after a layer's compute as a backward
        leaves the core (the ranks then meet: their computes end apart). A 16 MiB bucket so took 1.6-1.9x a
        sum in place (its copies a fifth of it), and a 4 MiB stage's all-reduce inside a step twice what a
        calibration on sums in place had predicted."""
        grads = [torch.ones(nbytes // 4 // pieces) for _ in range(pieces)]
        compute = _layer_compute()
        samples = []
        for _ in range(repeats + 1):
            compute()
            dist.barrier()
            start = time.perf_counter()
            flat = torch.cat(grads)
            dist.all_reduce(flat)
            for grad, summed in zip(grads, flat.split(grads[0].numel())):
                grad.copy_(summed)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[1:])

    def post_s(repeats: int) -> float:
        """What posting one small message costs the rank on average, sending and receiving alike, in the
        runtime's pattern: the receive posted ahead, before the compute that precedes its run (runtime/comm.py
        posts the next run's receives early), the send right after the compute that made its tensor, while
        the peer computes too; the call alone. After compute a send took 3-4x what it took after an idle
        pause (cold caches, gloo's threads woken on a busy core): 130-300 us against 40-110 us.
        The mean, not the median: a step pays the sum of its posts, and on a core gloo's threads share,
        some posts wait milliseconds for them."""
        message = torch.zeros(_PING_BYTES // 4)
        compute = _layer_compute()
        samples = []
        for index in range(2 * (repeats + 1)):  # the first of each direction warms it up
            sending = (index % 2 == 0) == (rank == 0)
            op = dist.P2POp(dist.isend if sending else dist.irecv, message, 1 - rank)
            dist.barrier()
            if sending:
                compute()
            start = time.perf_counter()
            works = dist.batch_isend_irecv([op])
            samples.append(time.perf_counter() - start)
            if not sending:
                compute()
            for work in works:
                work.wait()
        return statistics.mean(samples[2:])

    try:
        return (round_trip_s(_PING_BYTES, 20), round_trip_s(_STREAM_BYTES, 5),
                bucket_all_reduce_s(_STREAM_BYTES, _STREAM_PIECES, 7), post_s(60))
    finally:
        dist.destroy_process_group()


def _read_int_file(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for "no limit"


def _total_memory_bytes() -> int:
    """Physical memory of this machine, capped by a cgroup (container) memory limit if one is set."""
    total: int | None = None
    try:
        total = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024  # /proc/meminfo reports kB (KiB)
                    break
        except (OSError, ValueError, IndexError):
            total = None
    if total is None or total <= 0:
        raise InvalidArgument(
            "cannot determine this machine's memory (os.sysconf and /proc/meminfo both failed); "
            "describe the CPU as a JSON device file instead (see DeviceSpec.to_dict)"
        )
    for limit_path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        limit = _read_int_file(limit_path)
        if limit is not None and 0 < limit < total:
            total = limit
    return total


def measure_cpu_device(*, threads: int | None = None, link: LinkSpec | None = None,
                       collective: LinkSpec | None = None) -> DeviceSpec:
    """Benchmark this machine's CPU with torch (a few seconds) and describe it as a DeviceSpec.

    Measured: fp64/fp32/fp16/bf16 matmul FLOP/s (0 where torch cannot run the dtype), copy
    bandwidth, per-op overhead, each optimizer's step per parameter tensor and per parameter, and memory
    size. tf32 is 0 (CPUs have no TF32 mode). The host link
    is memcpy at the measured copy bandwidth; the intra- and inter-node links are ``link`` (what
    :func:`measure_gloo_links` measures between the runtime's CPU ranks; default a loopback memcpy,
    one machine, no network modelled), and all-reduces run as ``collective`` (its all-reduce link;
    default ``link``). The NVMe link is a documented default, not measured.
    Efficiencies are 1.0 because the peaks are already achieved figures. `threads` sets torch's
    intra-op thread count for the measurement only (default: torch's current setting).
    """
    import torch

    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InvalidArgument(f"threads must be a positive int or None, got {threads!r}")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            mem_bytes = _total_memory_bytes()
            fp64 = _matmul_tflops(torch.float64)
            fp32 = _matmul_tflops(torch.float32)
            fp16 = _matmul_tflops(torch.float16)
            bf16 = _matmul_tflops(torch.bfloat16)
            copy_gb_per_s = _copy_bandwidth_gb_per_s(mem_bytes)
            overhead_us = _op_overhead_us()
        optimizer_steps = measure_optimizer_steps(torch.device("cpu"), CPU_MIX, _COPY_MAX_BYTES,
                                                  foreach=True,  # as the runtime steps on every device
                                                  before=_layer_compute())  # after a backward, as it steps
    finally:
        if threads is not None:
            torch.set_num_threads(previous_threads)
    if fp32 <= 0.0:
        raise InvalidArgument(
            "fp32 matmul could not be measured on this CPU; describe it as a JSON device file instead"
        )
    loopback = LinkSpec(name="loopback memcpy (measured)", bandwidth_gb_per_s=copy_gb_per_s, latency_us=overhead_us)
    ranks = link or loopback
    return DeviceSpec(
        name=CPU_NAME,
        mem_bytes=mem_bytes,
        fp64_tflops=fp64,
        fp32_tflops=fp32,
        tf32_tflops=0.0,
        fp16_tflops=fp16,
        bf16_tflops=bf16,
        mem_bandwidth_gb_per_s=copy_gb_per_s,
        intra_node=ranks,
        # Same machine: "another node" is modelled as the same link; a CPU cluster needs a JSON device.
        inter_node=dataclasses.replace(ranks, name=f"{ranks.name}; no network modelled"),
        host_link=loopback,
        nvme=NVME_GEN3_X4,  # not measured (disk benchmarks are slow and touch the filesystem)
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        kernel_overhead_us=overhead_us,
        backend="gloo",
        collective_link=collective,
        optimizer_steps=optimizer_steps,
        host_mem_bytes=mem_bytes,  # the "device" is the host: one memory (each rank's share of it)
        # and the same cores: the host tier's Adam steps at the device's own measured rate, not a default
        host_optimizer_params_per_s=optimizer_steps["adam"].params_per_s(CPU_MIX),
        nvme_bytes=shutil.disk_usage(tempfile.gettempdir()).free,  # where --nvme-dir defaults to
    )


if __name__ == "__main__":  # one rank of measure_gloo_links: python -m cost_models.cpu_device RANK STORE
    import sys

    print(*_ping_pong(int(sys.argv[1]), sys.argv[2]))
