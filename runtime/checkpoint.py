"""Checkpoints: per stage, the model and optimizer state plus the step, written atomically.

Layout::

    DIR/step-00000012/stage-0.pt    {"step", "stage", "fingerprint", "model", "optimizer"}
    DIR/step-00000012/stage-1.pt
    DIR/latest.json                 {"step": 12, "fingerprint": ...}  (written last, by rank 0)

Each stage file is written by the stage's first replica (replicas hold identical weights and
optimizer state). ``latest.json`` moves only after every stage file of that step exists, so a
kill at any moment leaves the previous complete checkpoint in place. Files hold state dicts
(``torch.save``; loaded with ``weights_only=True``), never pickled plan objects.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cost_models.errors import CheckpointError
from runtime.executor import Executor
from runtime.stages import stage_state_tensors


def save(executor: Executor, directory: Path, step: int) -> None:
    """Write this rank's stage files for ``step`` (collective: every rank calls it)."""
    folder = directory / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    if executor.replica == 0:
        for stage in executor.stage_ids:
            payload = {"step": step, "stage": stage, "fingerprint": executor.plan.model.fingerprint,
                       **stage_state(executor, stage)}
            _atomic(folder / f"stage-{stage}.pt", lambda handle, p=payload: torch.save(p, handle))
    dist.barrier()
    if executor.rank == 0:
        latest = {"step": step, "fingerprint": executor.plan.model.fingerprint}
        _atomic(directory / "latest.json", lambda handle: handle.write(json.dumps(latest).encode()))
    dist.barrier()


def latest_step(directory: Path) -> int | None:
    """The step of the newest complete checkpoint in ``directory``, or None if there is none."""
    path = directory / "latest.json"
    if not path.exists():
        return None
    try:
        return int(json.loads(path.read_text())["step"])
    except (ValueError, KeyError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is corrupt ({error}); delete it to start over") from error


def restore(executor: Executor, directory: Path) -> int:
    """Load this rank's stages from the newest checkpoint; returns its step (0 if none)."""
    step = latest_step(directory)
    if step is None:
        return 0
    for stage in executor.stage_ids:
        path = directory / f"step-{step:08d}" / f"stage-{stage}.pt"
        saved = _load(path, executor.device)
        if saved.get("fingerprint") != executor.plan.model.fingerprint or saved.get("stage") != stage:
            raise CheckpointError(f"{path} belongs to another model or stage (fingerprint "
                                  f"{str(saved.get('fingerprint'))[:12]}..., stage {saved.get('stage')}); "
                                  f"resume with the plan that wrote it or use another --checkpoint-dir")
        load_stage_state(executor, stage, saved)
    executor.steps_done = step
    return step


def stage_state(executor: Executor, stage: int) -> dict[str, Any]:
    """The stage's parameters and buffers (by model name) and its optimizer's state dict."""
    local = executor.stages[stage]
    tensors = stage_state_tensors(executor.model, local)
    return {"model": {name: t.detach() for name, t in tensors.items()},
            "optimizer": local.optimizer.state_dict() if local.optimizer is not None else None}


def load_stage_state(executor: Executor, stage: int, saved: dict[str, Any]) -> None:
    local = executor.stages[stage]
    tensors = stage_state_tensors(executor.model, local)
    if set(saved["model"]) != set(tensors):
        raise CheckpointError(f"stage {stage}'s checkpoint holds {sorted(saved['model'])[:4]}... but "
                              f"the stage has {sorted(tensors)[:4]}...; it was written for another plan")
    with torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(saved["model"][name])
    if local.optimizer is not None and saved["optimizer"] is not None:
        local.optimizer.load_state_dict(saved["optimizer"])


def _load(path: Path, device: torch.device) -> dict[str, Any]:
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing although latest.json names its "
                              f"step; the checkpoint directory is incomplete") from None


def _atomic(path: Path, write: Any) -> None:
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            write(out)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
