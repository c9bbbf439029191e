"""The multi-process test harness: results by rank, child tracebacks, and timeouts."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import RankFailed, run_ranks

pytestmark = pytest.mark.dist


def all_reduce_rank(rank: int, world_size: int) -> list[float]:
    tensor = torch.tensor([float(rank), 1.0], dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one broke on purpose")
    return rank


def hang_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    dist.barrier()
    return rank


def test_results_come_back_by_rank() -> None:
    assert run_ranks(all_reduce_rank, 2) == [[1.0, 2.0], [1.0, 2.0]]


def test_a_failing_rank_reports_its_traceback() -> None:
    with pytest.raises(RankFailed, match="rank one broke on purpose"):
        run_ranks(raise_on_rank_one, 2)


def test_a_hanging_group_fails_within_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed):
        run_ranks(hang_on_rank_one, 2, timeout_s=5)
    assert time.monotonic() - start < 60
