"""Gather every rank's step times, losses, peak memory, swapped, halo and point-to-point bytes into the run report
(planner.reports.run_report)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from planner.reports.run_report import RunReport

MEMORY_MEASURES = {
    "cuda": "torch.cuda.max_memory_allocated",
    "cpu": "CPU tensor allocations of the last step, profiled, on top of the model state before it",
}


def gather_report(step_ms: list[float], losses: list[float], peak_bytes: int, held_bytes: int, *,
                  fingerprint: str, device: torch.device, global_batch_size: int,
                  start_step: int, host_swap_bytes: int = 0, halo_bytes_sent: int = 0, p2p_bytes_sent: int = 0,
                  optimizer_bytes: tuple[int, int] = (0, 0), busy_ms: list[float] | None = None,
                  action_ms: dict[str, float] | None = None) -> RunReport:
    """Combine every rank's measurements (collective); every rank gets the same report.

    ``step_ms``: this rank's wall time of each timed step (the report keeps every rank's, and per
    step the slowest).
    ``host_swap_bytes``: this rank's saved activations copied to the host in its last step.
    ``halo_bytes_sent``: what this rank's halo exchanges sent in its last step (Executor.halo_bytes_sent:
    forward halos, recomputed ones again, and halo gradients; 0 on a rank without a spatial stage).
    ``p2p_bytes_sent``: what this rank's pipeline sends (activations forward, gradients back) posted in its
    last step (Executor.p2p_bytes_sent).
    ``optimizer_bytes``: this rank's (host, NVMe) bytes of master weights and optimizer state
    after its last step (runtime/stage_optimizer.py), recorded when any rank holds some.
    ``busy_ms``: per timed step, this rank's wall time in compute actions (Executor.busy_ms); kept on
    CPU only, where an action's wall time is its compute (on CUDA the kernels run after it returns).
    ``action_ms``: per "stage:kind" (``0:F``), the median wall time of one such action, and under "post" the
    mean wall time of posting one message (CPU only, likewise).
    """
    times = torch.tensor(step_ms or [0.0], dtype=torch.float64, device=device)
    by_rank = [torch.zeros_like(times) for _ in range(dist.get_world_size())]
    dist.all_gather(by_rank, times)
    slowest = torch.stack(by_rank).amax(dim=0)
    busy = torch.tensor(busy_ms or [0.0] * max(1, len(step_ms)), dtype=torch.float64, device=device)
    busy_by_rank = [torch.zeros_like(busy) for _ in range(dist.get_world_size())]
    dist.all_gather(busy_by_rank, busy)
    actions: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(actions, action_ms or {})
    peaks = _gather_ints([peak_bytes, held_bytes, host_swap_bytes, *optimizer_bytes, halo_bytes_sent,
                          p2p_bytes_sent], device)
    offloaded = any(p[3] or p[4] for p in peaks)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return RunReport(fingerprint, dist.get_world_size(), name, global_batch_size, start_step,
                     tuple(slowest.tolist()) if step_ms else (), tuple(losses),
                     tuple(p[0] for p in peaks), MEMORY_MEASURES[device.type],
                     tuple(p[1] for p in peaks) if device.type != "cuda" else (),
                     host_swap_bytes=tuple(p[2] for p in peaks), halo_bytes_sent=tuple(p[5] for p in peaks),
                     p2p_bytes_sent=tuple(p[6] for p in peaks),
                     optimizer_host_bytes=tuple(p[3] for p in peaks) if offloaded else (),
                     optimizer_nvme_bytes=tuple(p[4] for p in peaks) if offloaded else (),
                     rank_step_ms=tuple(tuple(t.tolist()) for t in by_rank) if step_ms else (),
                     rank_busy_ms=tuple(tuple(t.tolist()) for t in busy_by_rank)
                     if busy_ms and device.type == "cpu" else (),
                     rank_action_ms=tuple(actions)  # type: ignore[arg-type]
                     if busy_ms and device.type == "cpu" else ())


def _gather_ints(values: list[int], device: torch.device) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]
