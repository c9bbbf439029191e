"""On one CUDA GPU: the host link's bandwidth each way, and how much of a copy hides behind compute.

The cost model's swap term (planner/search/terms.py) says a swapped activation's copies run on their own
copy engine, so they cost time only where they are slower than the compute they hide behind:
computing and copying together take max(compute, copy), not their sum. This measures that on the
runtime's own stream helpers (runtime/streams.py, the ones runtime/swap.py issues its copies on):

* pinned host-to-device, device-to-host and both at once (a swap-in of one micro-batch while the
  next swaps out), and pageable device-to-host, in GB/s;
* bf16 matmuls alone on the compute stream, a device-to-host copy alone on a side stream, then
  both issued together; the hidden share = (compute + copy - together) / min(compute, copy),
  1.0 when the copy hides entirely (what the swap term assumes) and 0.0 when they serialise;
* the same with the copy sized to take ~2x the compute, where the model says the copy is the pace.

Each figure is the median of REPEATS timed runs after a warm-up, the GPU synchronised around each.
Run (CUDA only): python benchmarks/cuda_overlap.py [--gib 1] [--device DEVICE_JSON]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.device_spec import BYTES_PER_GB  # noqa: E402
from cost_models.devices import get_device  # noqa: E402
from runtime.streams import current_stream, new_stream, use_stream  # noqa: E402

REPEATS = 7
MATMUL_SIZE = 8192


def seconds(work: Callable[[], object]) -> float:
    """Median seconds of ``work`` after one warm-up, the GPU synchronised around each run."""
    work()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        work()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes per copy, GiB (default 1)")
    parser.add_argument("--device", default=None,
                        help="device preset or JSON whose host link to print beside the measurement "
                             "(e.g. a `tessera calibrate --device cuda` file; default: the local GPU's preset)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"cuda_overlap.py measures a CUDA GPU; torch {torch.__version__} sees none here")
    device = torch.device("cuda", torch.cuda.current_device())
    if args.device is None:
        from cost_models.profiling import _preset_for_local_gpu
        spec = _preset_for_local_gpu(device)
    else:
        spec = get_device(args.device)
    size_bytes = int(args.gib * 2**30)
    on_gpu = torch.ones(size_bytes // 2, dtype=torch.bfloat16, device=device)
    back = torch.empty_like(on_gpu)
    pinned = torch.empty(on_gpu.shape, dtype=on_gpu.dtype, pin_memory=True)
    pinned_in = torch.ones(on_gpu.shape, dtype=on_gpu.dtype, pin_memory=True)
    pageable = torch.empty(on_gpu.shape, dtype=on_gpu.dtype)
    compute_stream, copy_out, copy_in = current_stream(device), new_stream(device), new_stream(device)

    def out_copy() -> None:
        copy_out.wait_stream(compute_stream)
        with use_stream(copy_out):
            pinned.copy_(on_gpu, non_blocking=True)

    def in_copy() -> None:
        copy_in.wait_stream(compute_stream)
        with use_stream(copy_in):
            back.copy_(pinned_in, non_blocking=True)

    gb = size_bytes / BYTES_PER_GB
    d2h, h2d = seconds(out_copy), seconds(in_copy)
    both_ways = seconds(lambda: (out_copy(), in_copy()))
    d2h_pageable = seconds(lambda: pageable.copy_(on_gpu))
    print(f"{torch.cuda.get_device_name(device)}; copies of {args.gib:g} GiB, median of {REPEATS}")
    print(f"host link, predicted ({spec.name}): {spec.host_link.bandwidth_gb_per_s:.1f} GB/s each way")
    print(f"pinned device->host {gb / d2h:.1f} GB/s, host->device {gb / h2d:.1f} GB/s, both at once "
          f"{2 * gb / both_ways:.1f} GB/s together ({both_ways / max(d2h, h2d):.2f}x the slower one alone); "
          f"pageable device->host {gb / d2h_pageable:.1f} GB/s")

    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    one_matmul = seconds(lambda: torch.matmul(a, b))
    print(f"{'copy / compute':>15} {'compute ms':>11} {'copy ms':>9} {'together ms':>12} "
          f"{'predicted ms':>13} {'hidden share':>13}")
    for ratio in (0.5, 1.0, 2.0):
        count = max(1, round(d2h / ratio / one_matmul))

        def compute(count: int = count) -> None:
            for _ in range(count):
                torch.matmul(a, b)

        alone = seconds(compute)
        together = seconds(lambda: (out_copy(), compute()))
        hidden = (alone + d2h - together) / min(alone, d2h)
        print(f"{d2h / alone:>15.2f} {alone * 1e3:>11.1f} {d2h * 1e3:>9.1f} {together * 1e3:>12.1f} "
              f"{max(alone, d2h) * 1e3:>13.1f} {hidden:>13.2f}")


if __name__ == "__main__":
    main()
