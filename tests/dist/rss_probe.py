"""Resident memory of one-rank runs after their last step: ``python -m tests.dist.rss_probe NVME_DIR``.

The runs: a one-stage GPT (3.7 M fp32 parameters, Adam) with its optimizer state on the device
(the CPU here), then paged to NVME_DIR, each in a child forked from this fresh process once
the plans are made (so both start from the same imports, and neither sees the other's heap).

Prints one JSON line, per tier: ``rss_bytes`` (from /proc/self/statm, once the paged state's write has
ended, after ``malloc_trim(0)``: glibc keeps freed heap pages resident, which would count what
the allocator caches rather than what the run holds; ``untrimmed_rss_bytes`` is the figure
before it) and ``optimizer_state_bytes`` (Adam's two moments of every parameter).
Run in a fresh process so one run's allocations do not hide another's.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def resident_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def gpt_plan(tier: str) -> str:
    from cost_models.graph.model_spec import build_model, load_builder
    from planner.manual import plan_with_split
    from planner.plan import OffloadSpec, StateTier

    builder = "examples/models/gpt.py:gpt"
    kwargs = {"hidden": 256, "layers": 2, "heads": 4, "seq_len": 32, "vocab": 8192, "dropout": 0.0}
    plan = plan_with_split(build_model(load_builder(builder), kwargs, "meta"),
                           example_inputs=torch.empty(1, 32, dtype=torch.long, device="meta"),
                           stage_starts=[], batch_size=4, micro_batch_size=2, data_parallel=1,
                           schedule="gpipe", device="V100-16GB", optimizer="adam", precision="fp32",
                           builder=builder, builder_kwargs=kwargs,
                           offload=[OffloadSpec(optimizer_state=StateTier(tier))])
    return plan.to_json()


def run(plan_json: str, nvme_dir: str | None) -> dict[str, int]:
    """Train 3 steps in a one-rank group, then measure while the executor (and its state) is alive."""
    from planner.plan import Plan
    from runtime.build import rebuild_model
    from runtime.data import SyntheticData, input_specs, synthetic_task
    from runtime.executor import Executor
    from runtime.optim import optimizer_factory

    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/file", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        plan = Plan.from_dict(json.loads(plan_json))
        exe = Executor(plan, rebuild_model(plan), lambda out, target: out, optimizer_factory("adam"),
                       device="cpu", timeout_s=60, nvme_dir=nvme_dir)
        data = SyntheticData(input_specs(exe.traced, dict(exe.flow.specs)),
                             synthetic_task(exe.flow.specs[exe.flow.output_names[0]]), 0)
        exe.loss_fn = data.task
        for step in range(3):
            batch = data.samples(step, 0, plan.training.global_batch_size)
            exe.step(batch.inputs, batch.targets)
        states = [stage.state for stage in exe.stages.values() if stage.state is not None]
        for state in states:
            if state.pager is not None:
                state.pager.wait()
        param_bytes = sum(p.numel() * p.element_size() for state in states for p in state.params)
        untrimmed = resident_bytes()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return {"rss_bytes": resident_bytes(), "untrimmed_rss_bytes": untrimmed,
                "optimizer_state_bytes": 2 * param_bytes,  # Adam: two moments
                "nvme_bytes": sum(state.nvme_bytes for state in states),
                "host_bytes": sum(state.host_bytes for state in states)}


def in_child(plan_json: str, nvme_dir: str | None) -> dict[str, int]:
    """:func:`run` in a forked child: both tiers start from this process's state, nothing else."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's exit handlers
        os.close(read_end)
        try:
            os.write(write_end, json.dumps(run(plan_json, nvme_dir)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    if not text:
        raise RuntimeError(f"the {'nvme' if nvme_dir else 'gpu'} run failed (see its traceback above)")
    return json.loads(text)


def main(nvme_dir: str) -> dict[str, dict[str, int]]:
    torch.set_num_threads(1)
    plans = {tier: gpt_plan(tier) for tier in ("gpu", "nvme")}  # imports what the runs need, once
    return {"gpu": in_child(plans["gpu"], None), "nvme": in_child(plans["nvme"], nvme_dir)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
