"""The torchrun agent of `tessera run`: torch.distributed.run, ending as its first failed rank did.

``python -m runtime.agent TORCHRUN_ARGS`` takes torchrun's own arguments and runs its elastic
agent, which starts the ranks (each in its own session) and stops them all when one fails or when
the agent gets SIGTERM/SIGINT (SIGTERM, then SIGKILL after ``--shutdown-timeout``). What differs
from ``torchrun``: its log lines and its ChildFailedError report are not printed (each rank
prints its own one line: runtime/command.py), and the exit status is the first failed rank's
(2 for a refused set-up, 1 for a failure), or 128 + the signal that stopped the agent. When the
ranks that said why had only lost a peer, each rank that died without a word (killed by a signal,
or an exit status of its own) gets one line here, and the job exits 1 (or that rank's status).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, parse_args, run

from runtime.command import EXIT_FAILED, EXIT_PEER_LOST, SAID_STATUSES


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun's agent on ``argv`` (torchrun's arguments); returns the job's exit status."""
    logging.disable(logging.ERROR)  # torchrun's warnings and its multi-line failure report
    args = parse_args(known_options(list(sys.argv[1:] if argv is None else argv)))
    try:
        run(args)
    except ChildFailedError as error:
        return failure_status(error)
    except SignalException as error:  # the ranks are stopped already
        return 128 + int(error.sigval)
    except Exception as error:  # noqa: BLE001 - rendezvous and start-up errors: one line, not a traceback
        print(f"tessera: torchrun could not start the job: {type(error).__name__}: "
              f"{' '.join(str(error).split())}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return 0


def known_options(argv: list[str]) -> list[str]:
    """``argv`` less ``--shutdown-timeout S`` where this torch's torchrun lacks the option (torch 2.11 does):
    its agent then stops the ranks with its own SIGTERM-to-SIGKILL grace."""
    if any("--shutdown-timeout" in action.option_strings for action in get_args_parser()._actions):
        return argv
    at = argv.index("--shutdown-timeout") if "--shutdown-timeout" in argv else -1
    return argv if at < 0 else argv[:at] + argv[at + 2:]


def failure_status(error: ChildFailedError) -> int:
    """The job's exit status; one line for each rank that left without saying why when no rank failed of itself.

    A rank's failure is its own when it left with a status of the runtime's other than a lost peer: the job then
    ends with the first such rank's status, and ranks killed by a signal were stopped by the agent. When every
    rank that said why had lost a peer, the cause is a rank that died without a word (killed by a signal, or an
    exit status of its own): each is named, since torchrun's first failure (the earliest whole-second
    timestamp, the lowest rank on a tie) may be a rank left waiting for it.
    """
    own = {rank: failure for rank, failure in error.failures.items()
           if failure.exitcode in SAID_STATUSES and failure.exitcode != EXIT_PEER_LOST}
    if own:
        return min(own.values(), key=lambda failure: failure.timestamp).exitcode
    silent = {rank: failure for rank, failure in sorted(error.failures.items())
              if failure.exitcode not in SAID_STATUSES}
    for rank, failure in silent.items():
        how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with status {failure.exitcode}")
        print(f"tessera: rank {rank} (pid {failure.pid}) {how}", file=sys.stderr, flush=True)
    statuses = [failure.exitcode for failure in silent.values() if failure.exitcode > 0]
    return statuses[0] if statuses else EXIT_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
