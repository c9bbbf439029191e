"""``python -m runtime`` under torchrun: its flags, one line per failure, and its exit statuses.

Usage::

    torchrun --nproc-per-node N -m runtime PLAN --steps K [--report run.json]
             [--checkpoint-dir DIR [--checkpoint-every N] [--resume]] [--seed S] [--lr LR]
             [--timeout-s T] [--device auto|cpu|cuda] [--leaf NAME ...] [--nvme-dir DIR]

Set-up is checked before any training: the world size against the plan, the plan's schema and
layout, the rebuilt model's fingerprint, the checkpoint to resume from. NCCL is used on CUDA and
gloo on CPU, with a timeout on the process group and on every wait (runtime/launch.py).
Failure behaviour: an error every rank detects alike (a set-up mismatch) is printed once, by
rank 0, which exits with status 2 (the other ranks wait a grace period for torchrun to stop
them, and print it themselves only if it does not); any other error is printed by the rank that
raised it (once), and that rank exits with status 1 at once (no group teardown that could hang),
so torchrun stops the others; ranks that lose a peer or time out print one line and exit 3 (a failure
another rank caused: `tessera run`'s agent then names the rank that died without a word); a rank
interrupted (SIGINT from its agent) exits 130 without a traceback.

Test hook (hidden from ``--help``): ``--fail-at-step K --fail-rank R`` makes rank R raise
before step K, to test that a failing rank brings the job down promptly.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from cost_models.errors import CheckpointError, PeerFailure, RankFailure, RuntimeSetupError, TesseraError
from runtime.launch import RankEnv, init_group, rank_or_zero
from runtime.train import RunOptions

if TYPE_CHECKING:
    from planner.plan import Plan

EXIT_SETUP = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
EXIT_PEER_LOST = 3  # a peer was lost or did not answer in time: the cause is another rank
SAID_STATUSES = frozenset({EXIT_FAILED, EXIT_SETUP, EXIT_INTERRUPTED, EXIT_PEER_LOST})  # said before exiting
SETUP_ERROR_GRACE_S = 20.0


class _Parser(argparse.ArgumentParser):
    """Usage errors become set-up errors, so rank 0 alone prints them."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise RuntimeSetupError(f"{message} (see 'python -m runtime --help')")


def parse_args(argv: Sequence[str] | None) -> tuple[RunOptions, str]:
    parser = _Parser(prog="python -m runtime", description="Train a plan's model on "
                                     "synthetic data, one process per GPU (start it with torchrun).")
    parser.add_argument("plan", type=Path, help="plan file from `tessera plan -o`")
    parser.add_argument("--steps", type=int, required=True, help="train until this many steps are done")
    parser.add_argument("--report", type=Path, default=None, help="write the run report (JSON) here")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="write checkpoints here")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in --checkpoint-dir")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, data and dropout")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default per optimizer)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="process group and wait timeout")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: CPU ranks (gloo) for a plan made for the cpu device, else CUDA where "
                             "available")
    parser.add_argument("--leaf", action="append", default=[], help="leaf module the plan was traced with")
    parser.add_argument("--nvme-dir", type=Path, default=None,
                        help="directory (a local SSD) for stages whose optimizer state the plan puts on NVMe")
    parser.add_argument("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fail-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir DIR, the directory whose newest checkpoint "
                     "to continue from")
    return RunOptions(args.plan, args.steps, args.report, args.checkpoint_dir, args.checkpoint_every,
                      args.resume, args.seed, args.lr, args.timeout_s, tuple(args.leaf),
                      nvme_dir=args.nvme_dir, fail_at_step=args.fail_at_step,
                      fail_rank=args.fail_rank), args.device


def _device_kind(plan: Plan, choice: str) -> str:
    """What ``--device auto`` runs ``plan`` on: a plan costed for CPU ranks (gloo) runs on CPU ranks even
    where a GPU is present (its predictions are the CPU's); any other choice stands."""
    return "cpu" if choice == "auto" and plan.cluster.backend == "gloo" else choice


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m runtime``; returns the exit status (failures never return)."""
    rank = rank_or_zero()
    try:
        options, device_choice = parse_args(argv)
        from planner.nvme_dir import check_nvme_dir
        from planner.plan import Plan
        from runtime import checkpoint, checks, train

        env = RankEnv.from_environ()
        plan = Plan.load(options.plan)
        checks.check_plan(plan)
        checks.check_executable(plan)
        checks.check_world_size(plan, env.world_size)
        check_nvme_dir(plan, options.nvme_dir, plan.layout.parts_of_rank(env.rank),
                       printer_parts=plan.layout.parts_of_rank(0))
        if options.checkpoint_dir is not None:
            checkpoint.check_writable(options.checkpoint_dir)
        device = init_group(env, _device_kind(plan, device_choice), options.timeout_s)
        report = train.run(plan, options, device)
        if env.rank == 0 and options.report is not None:
            report.save(options.report)
            print(f"run report written to {options.report}", flush=True)
        del report
        gc.collect()  # free the executor (and the groups and works it references) while gloo is up
        dist.barrier()  # leave together: a gloo peer closing early can abort the other's teardown
        dist.destroy_process_group()
        return 0
    except PeerFailure as error:
        _stop(f"tessera: {error}", EXIT_PEER_LOST)  # the message names this rank and what it awaited
    except TesseraError as error:
        text = f"tessera: error: {' '.join(str(error).split())}"
        if rank != 0 and _same_on_every_rank(error):
            # Rank 0 meets the same error and prints it; torchrun stops this rank once rank 0
            # exits. Print it here only if that has not happened within the grace period.
            time.sleep(SETUP_ERROR_GRACE_S)
        _stop(text, EXIT_SETUP)
    except SystemExit:  # --help
        raise
    except KeyboardInterrupt:  # torchrun's agent forwards the user's Ctrl-C: leave quietly
        _stop(None, EXIT_INTERRUPTED)
    except BaseException:  # noqa: BLE001 - any failure must end this rank promptly and visibly
        _stop(f"tessera: rank {rank} failed:\n{traceback.format_exc()}", EXIT_FAILED)
    return EXIT_FAILED  # not reached: _stop exits


def _same_on_every_rank(error: TesseraError) -> bool:
    """Plan, model and set-up errors repeat on every rank; checkpoint and rank failures do not
    unless the error says so (a checkpoint every rank reads alike)."""
    default = not isinstance(error, (CheckpointError, RankFailure))
    return bool(getattr(error, "same_on_every_rank", default))


def _stop(message: str | None, status: int) -> None:
    """Print ``message`` and leave now, without tearing down a group whose peers may be gone."""
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)
