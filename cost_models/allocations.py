"""The most a profiled block allocated on the CPU, from the PyTorch profiler's allocation events.

The CPU allocator keeps no peak of its own (CUDA's ``max_memory_allocated`` does): run the block under
``torch.profiler.profile(profile_memory=True)`` and replay its allocations (+) and frees (-) in time order.
The runtime measures a step's peak this way (runtime/memory.py), the profiler each node's backward
(cost_models/profiling.py).
"""

from __future__ import annotations

import bisect
import os
from typing import Any


def allocation_profiler() -> Any:
    """A ``torch.profiler.profile`` of the CPU recording allocations, as both measurements run it. Its library's
    own log is silenced unless ``KINETO_LOG_LEVEL`` says otherwise: libkineto prints a line as each profiler
    starts and stops (a ``USDT:`` line per rank and profiled step of a run, and per profile), and reads the
    level when the first one starts."""
    import torch

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # past its last level: none of its lines
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)


def _cpu_allocations(profile: Any) -> list[tuple[int, int]]:
    """(start ns, bytes: + allocated, - freed) of every CPU allocation event, in time order."""
    import torch

    return sorted(((event.start_ns(), event.nbytes()) for event in profile.profiler.kineto_results.events()
                   if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU),
                  key=lambda allocation: allocation[0])  # stable: events at one instant in recorded order


def allocated_peak_bytes(profile: Any) -> int:
    """The highest running sum of the profiled CPU allocations, above what was allocated when it began."""
    running = peak = 0
    for _, nbytes in _cpu_allocations(profile):
        running += nbytes
        peak = max(peak, running)
    return peak


def peaks_within(profile: Any, label: str) -> dict[str, int]:
    """Per ``torch.profiler.record_function`` range named ``label`` + name: the most allocated inside it
    above what was allocated when it began."""
    allocations = _cpu_allocations(profile)
    starts = [start for start, _ in allocations]
    running, total = [], 0
    for _, nbytes in allocations:
        total += nbytes
        running.append(total)
    peaks = {}
    for event in profile.profiler.kineto_results.events():
        if not event.name().startswith(label):
            continue
        first = bisect.bisect_left(starts, event.start_ns())
        last = bisect.bisect_right(starts, event.end_ns())
        before = running[first - 1] if first else 0
        peaks[event.name().removeprefix(label)] = max([0, *(value - before for value in running[first:last])])
    return peaks
