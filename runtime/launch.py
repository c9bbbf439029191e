"""Rank set-up under torchrun: the only place that reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*.

``join_group`` is what both ``python -m runtime`` (runtime/command.py) and an ``Executor`` made
in a user's torchrun script call when torch.distributed is not initialised yet: it reads this
process's place from the environment, picks the device and the backend (NCCL on CUDA, gloo on
CPU) and joins the process group with a timeout.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cost_models.cpu_device import rank_threads, settle_cpu_rank
from cost_models.errors import RuntimeSetupError

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankEnv:
    """What torchrun tells this process about itself."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> RankEnv:
        missing = [name for name in _REQUIRED if name not in os.environ]
        if missing:
            raise RuntimeSetupError(f"torch.distributed is not initialised and the environment variables "
                                    f"{missing} are not set: start the job with `tessera run PLAN`, "
                                    f"`torchrun --nproc-per-node N -m runtime PLAN` or `torchrun "
                                    f"--nproc-per-node N your_script.py`, or call "
                                    f"torch.distributed.init_process_group first")
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                   int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


def rank_or_zero() -> int:
    """This process's rank as torchrun set it, or 0 outside torchrun (for who prints what)."""
    return int(os.environ.get("RANK", "0"))


def init_group(env: RankEnv, device_choice: str, timeout_s: float) -> torch.device:
    """Pick the device and backend (NCCL on CUDA, gloo on CPU) and join the process group."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeSetupError("--device cuda but CUDA is not available on this machine")
    device = torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    if use_cuda:
        torch.cuda.set_device(device)
        # its share of the cores, for the host's work (an optimizer step on the host tier): torchrun's
        # default of one thread per rank would make that step many times slower than costed
        torch.set_num_threads(rank_threads(local_ranks))
    else:
        settle_cpu_rank(env.local_rank, local_ranks)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if use_cuda else None)
    return device


def join_group(device_choice: str, timeout_s: float) -> torch.device:
    """Join the process group torchrun's environment describes; returns this rank's device.

    ``device_choice`` is ``auto`` (CUDA if available), ``cpu`` or ``cuda``; ``timeout_s``
    bounds the rendezvous and every collective of the default group.
    """
    return init_group(RankEnv.from_environ(), device_choice, timeout_s)
