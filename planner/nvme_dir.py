"""Checks of ``--nvme-dir`` made before any work (by `tessera run` and by every rank): the directory
exists, is writable and has room for the master weights and optimizer state the plan pages there.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from cost_models.errors import RuntimeSetupError
from cost_models.memory import get_optimizer, get_precision, shard_numel
from planner.plan import Plan, StateTier


def paged_bytes(plan: Plan, stages: Iterable[int]) -> int:
    """Bytes the NVMe files of ``stages`` need: master weights plus optimizer state, per element.

    The stage's parameter count comes from the plan (``predicted.param_bytes`` / itemsize); a
    ZeRO stage's replicas each page their shard.
    """
    precision = get_precision(plan.model.precision)
    per_element = (1 + get_optimizer(plan.training.optimizer).state_count) * precision.state_itemsize
    total = 0
    for index in stages:
        stage = plan.stages[index]
        if stage.offload.optimizer_state is not StateTier.NVME:
            continue
        numel = stage.predicted.param_bytes // precision.itemsize
        if stage.offload.zero_stage >= 1:
            numel = shard_numel(numel, plan.data_parallel)
        total += numel * per_element
    return total


def nvme_stages(plan: Plan) -> list[int]:
    return [stage.index for stage in plan.stages if stage.offload.optimizer_state is StateTier.NVME]


def check_nvme_dir(plan: Plan, directory: Path | None, parts: Iterable[int], *,
                   printer_parts: Iterable[int] | None = None) -> None:
    """Refuse, before any work, a missing, unwritable or too small ``--nvme-dir`` (one line each) for
    ``parts`` (indices of ``plan.stages``: a layout stage's part is ``plan.layout.part(stage)``).

    ``printer_parts``: the parts of the rank that prints the set-up errors every rank meets (rank 0).
    The error counts as met by every rank only if that rank pages to NVMe too; otherwise the rank that
    meets it prints it at once. None: one process checks for all.
    """
    paged = [index for index in parts if plan.stages[index].offload.optimizer_state is StateTier.NVME]
    if not paged:
        return
    shared = printer_parts is None or any(plan.stages[index].offload.optimizer_state is StateTier.NVME
                                          for index in printer_parts)
    try:
        _check_paged(plan, directory, paged)
    except RuntimeSetupError as error:
        raise RuntimeSetupError(str(error), same_on_every_rank=shared) from None


def _check_paged(plan: Plan, directory: Path | None, paged: list[int]) -> None:
    if directory is None:
        raise RuntimeSetupError(f"stages {paged} keep their optimizer state on NVMe but no --nvme-dir "
                                f"was given; pass --nvme-dir DIR on a local SSD")
    if not directory.is_dir():
        raise RuntimeSetupError(f"--nvme-dir {directory} does not exist (or is not a directory); "
                                f"create it (mkdir -p {directory}) or pass another --nvme-dir")
    try:  # a real write: os.access says yes to root on a read-only file system
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise RuntimeSetupError(f"--nvme-dir {directory} is not writable ({error.strerror}); fix its "
                                f"permissions or pass another --nvme-dir") from None
    needed, free = paged_bytes(plan, paged), shutil.disk_usage(directory).free
    if free < needed:
        raise RuntimeSetupError(f"--nvme-dir {directory} has {free} bytes free but stages {paged} page "
                                f"{needed} bytes of master weights and optimizer state there; free space "
                                f"or pass a --nvme-dir on a larger disk")
