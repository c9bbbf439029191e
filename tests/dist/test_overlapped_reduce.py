"""The data-parallel all-reduce started during the last backward (runtime/grads.py's OverlappedReduce, as
DDP's): with small buckets it launches buckets while the backward still runs, in the same order on every
rank, and its sums equal the all-reduce after the backward, including parameters the last micro-batch
left without a new gradient and parameters that never got one (skipped, as the optimizer skips them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from runtime.grads import GradientSync, OverlappedReduce
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4), torch.nn.Linear(4, 4))
    return torch.nn.ModuleDict({"body": body, "unused": torch.nn.Linear(2, 2)}).double()  # unused: never a gradient


def _loss(model: torch.nn.Module, rank: int, microbatch: int, *, skip_last: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + microbatch)
    x = torch.randn(3, 8, generator=generator, dtype=torch.float64)
    head = model["body"][:5](x)
    return (head if skip_last else model["body"][5](head)).square().sum()


def _rank(rank: int, world_size: int) -> dict[str, object]:
    group = dist.new_group(list(range(world_size)))
    results: dict[str, object] = {}
    for overlapped in (False, True):
        model = _model()
        _loss(model, rank, 0, skip_last=False).backward()
        params = [p for p in model.parameters() if p.requires_grad]
        sync = GradientSync(torch.device("cpu"), timeout_s=30, bucket_bytes=200)  # a bucket per parameter or so
        if overlapped:
            reduce = OverlappedReduce(sync, params, group, "test")
            loss = _loss(model, rank, 1, skip_last=True)  # the last layer gets no gradient this time
            reduce.arm([loss])
            loss.backward()
            results["buckets"] = len(reduce.buckets)
            results["launched_in_backward"] = len(reduce.launched)
            results["armed"] = reduce.armed
            reduce.wait()
        else:
            _loss(model, rank, 1, skip_last=True).backward()
            sync.all_reduce(params, group, "test")
        results[f"grads_{overlapped}"] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return results


def test_buckets_start_during_the_backward_and_sum_as_after_it() -> None:
    by_rank = run_ranks(_rank, 2, timeout_s=120)
    for result in by_rank:
        assert result["buckets"] >= 4
        assert result["launched_in_backward"] == result["buckets"]  # all launched before the backward returned
        assert result["armed"]
        for plain, overlapped in zip(result["grads_False"], result["grads_True"]):
            assert (plain is None) == (overlapped is None)
            if plain is not None:
                torch.testing.assert_close(overlapped, plain, rtol=0, atol=0)
    torch.testing.assert_close(by_rank[0]["grads_True"][0], by_rank[1]["grads_True"][0], rtol=0, atol=0)
