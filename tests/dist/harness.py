"""Run a function on several CPU processes joined by gloo, with a timeout and child tracebacks."""

from __future__ import annotations

import io
import multiprocessing as mp
import queue
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PRELOADED = ("torch", "torch.distributed", "torch._dynamo", "planner", "runtime.executor", "tests.dist.harness")
"""What the ranks' processes start with, imported once (torch._dynamo: fake tensors import it)."""


class RankFailed(AssertionError):
    """A rank raised, or the group did not finish in time; carries every child's traceback."""


def _child(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple,
           results: Any, timeout_s: float) -> None:
    import datetime

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            results.put((rank, "ok", _to_bytes(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; returns results by rank.

    ``fn`` must be importable (a module-level function). Raises RankFailed with the child
    tracebacks if any rank raises, and kills the group if it runs past ``timeout_s``.
    """
    context = _forked_from_a_server()
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        processes = [context.Process(target=_child, args=(rank, world_size, init_file, fn, args,
                                                          results, timeout_s), daemon=True)
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        outcomes = _collect(results, world_size, timeout_s + 30)
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    errors = {rank: detail for rank, (status, detail) in outcomes.items() if status != "ok"}
    if errors or len(outcomes) < world_size:
        missing = sorted(set(range(world_size)) - set(outcomes))
        report = "".join(f"\n--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items()))
        raise RankFailed(f"ranks failed: {sorted(errors)}; no answer from {missing}{report}")
    return [_from_bytes(outcomes[rank][1]) for rank in range(world_size)]


def _forked_from_a_server() -> Any:
    """Processes forked from multiprocessing's fork server, which imports :data:`PRELOADED` once per test
    session: a spawned process imports torch and the runtime again (about 3 s, most of a small test's
    time), and a fork of the test process itself would inherit whatever threads and state its tests left.
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


def _to_bytes(result: Any) -> bytes:
    """A rank's result as bytes: a queue would share its tensors' storage by file descriptor, which the
    parent can open only while the child is alive (a child that exits first fails the test)."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _collect(results: Any, world_size: int, deadline_s: float) -> dict[int, tuple[str, Any]]:
    import time

    outcomes: dict[int, tuple[str, Any]] = {}
    end = time.monotonic() + deadline_s
    while len(outcomes) < world_size and time.monotonic() < end:
        try:
            rank, status, detail = results.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            break
        outcomes[rank] = (status, detail)
        if status != "ok":  # one failure: give the others a moment to report, then stop waiting
            end = min(end, time.monotonic() + 3)
    return outcomes


