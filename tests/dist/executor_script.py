"""A user's torchrun script: an Executor made without init_process_group; rank 0 prints the losses.

Usage: ``torchrun --nproc-per-node N -m tests.dist.executor_script PLAN STEPS`` (from the repository root)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from tests.dist.runtime_cases import Case, run_case


def main(plan_path: str, steps: int) -> None:
    outcome = run_case(Case(Path(plan_path).read_text(), steps=steps))
    if dist.get_rank() == 0:
        print("losses", json.dumps(outcome.losses), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
