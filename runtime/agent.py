"""The torchrun agent of `tessera run`: torch.distributed.run, ending as its first failed rank did.

``python -m runtime.agent TORCHRUN_ARGS`` takes torchrun's own arguments and runs its elastic
agent, which starts the ranks (each in its own session) and stops them all when one fails or when
the agent gets SIGTERM/SIGINT (SIGTERM, then SIGKILL after ``--shutdown-timeout``). What differs
from ``torchrun``: its log lines and its ChildFailedError report are not printed (each rank
prints its own one line: runtime/command.py), and the exit status is the first failed rank's
(2 for a refused set-up, 1 for a failure), or 128 + the signal that stopped the agent. Each rank
that dies without a word (killed by a signal, or an exit status of its own) gets one line here.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, parse_args, run

EXIT_FAILED = 1
RUNTIME_STATUSES = frozenset({1, 2, 130})  # the statuses with which runtime/command.py leaves, said


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
    """The job's exit status, from the rank that failed first; one line for each rank that left without saying
    why.

    A rank that died without a word (killed by a signal, or an exit status of its own) is the cause when there is
    one: the ranks it left waiting fail because of it, and may be reported in the same second (torchrun's
    timestamps are whole seconds, and its first failure is then the lowest rank).
    """
    silent = {rank: failure for rank, failure in sorted(error.failures.items())
              if failure.exitcode not in RUNTIME_STATUSES}
    for rank, failure in silent.items():
        how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with status {failure.exitcode}")
        print(f"tessera: rank {rank} (pid {failure.pid}) {how}", file=sys.stderr, flush=True)
    if not silent:
        return error.get_first_failure()[1].exitcode
    first = min(silent.values(), key=lambda failure: failure.timestamp)
    return EXIT_FAILED if first.exitcode < 0 else first.exitcode


if __name__ == "__main__":
    raise SystemExit(main())
