"""The run report's halo bytes and per-rank step times: gathered, kept through JSON, optional."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist

from planner.reports.run_report import RunReport
from runtime.report import gather_report


def _gathered(tmp_path: Path, halo_bytes_sent: int) -> RunReport:
    """gather_report in a one-process gloo group (every collective it makes, with one rank)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        return gather_report([12.0, 10.0], [2.5, 2.0], 1000, 900, fingerprint="f" * 64,
                             device=torch.device("cpu"), global_batch_size=8, start_step=0,
                             host_swap_bytes=300, halo_bytes_sent=halo_bytes_sent)
    finally:
        dist.destroy_process_group()


def test_the_report_records_each_ranks_halo_bytes_and_reads_older_reports_without_them(tmp_path: Path) -> None:
    report = _gathered(tmp_path, 58368)
    assert report.halo_bytes_sent == (58368,) and report.host_swap_bytes == (300,)
    assert report.rank_step_ms == ((12.0, 10.0),) and report.rank_median_step_ms == (10.0,)
    report.save(tmp_path / "run.json")
    assert RunReport.load(tmp_path / "run.json") == report  # the nested per-rank step times too
    older = {key: value for key, value in json.loads((tmp_path / "run.json").read_text()).items()
             if key != "halo_bytes_sent"}
    assert RunReport.from_dict(older).halo_bytes_sent == ()
