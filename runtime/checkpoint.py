"""Checkpoints: per stage, the model and optimizer state plus the step, written atomically.

Layout::

    DIR/step-00000012/stage-0.pt    {"step", "stage", "fingerprint", "model", "optimizer", "precision",
                                     "stashed"}
    DIR/step-00000012/stage-1.pt
    DIR/latest.json                 {"step": 12, "fingerprint": ..., "split": ..., "stage_starts": [...]}
                                    (written last, by rank 0)

Each stage file is written by the stage's first replica (replicas hold identical weights and
optimizer state) and holds the full state whatever the plan's offload section says: ZeRO
shards are gathered first (every replica takes part), and state paged to NVMe or kept on the
host is read back (runtime/stage_optimizer.py), so a checkpoint resumes under any of them. Under
fp16/bf16 ``precision`` holds the stage's whole fp32 master weights and the loss scaler's state
(runtime/precision.py), the optimizer state is the masters' and ``model`` the 16-bit weights, so a
resumed run continues exactly; otherwise it is None. A stage on stashed weight versions (WPipe's first
group, runtime/stale.py) also saves, as ``stashed``, the older version the next step's forwards read
(None elsewhere); the run flushes before each checkpoint (runtime/train.py), so no forward has run ahead
of it, and a resumed run runs them first, as after any flush. ``latest.json`` moves only after every
stage file of that step exists, so a kill at any moment leaves the previous complete checkpoint in
place. It names the model
(fingerprint) and how the plan cut it into stages (``split``, a digest of the node-to-stage map),
so resuming with another model or another cut is refused before any stage file is read, by every
rank alike. Files hold state dicts (``torch.save``; loaded with ``weights_only=True``), never
pickled plan objects.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cost_models.errors import CheckpointError, describe_error
from planner.plan import Plan
from runtime.executor import Executor
from runtime.stages import stage_state_tensors


@dataclass(frozen=True)
class Latest:
    """What ``latest.json`` says of the newest complete checkpoint."""

    step: int
    fingerprint: str
    split: str | None = None  # None in checkpoints written before the split was recorded
    stage_starts: tuple[str, ...] = ()


def split_digest(plan: Plan) -> str:
    """A digest of the plan's node-to-stage map: equal for plans that cut the model alike."""
    return hashlib.sha256(json.dumps(sorted(plan.part_of().items())).encode()).hexdigest()[:16]


def check_writable(directory: Path) -> None:
    """Refuse, before any step, a ``--checkpoint-dir`` that cannot be made or written (a read-only file system, a
    path under a file): found at the first checkpoint it cost the steps before it, in a traceback per rank."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".tessera-write-test-"):
            pass
    except OSError as error:
        raise CheckpointError(f"--checkpoint-dir {directory} cannot be written ({error.strerror}); give a "
                              f"writable folder", same_on_every_rank=True) from error


def save(executor: Executor, directory: Path, step: int) -> None:
    """Write this rank's stage files for ``step`` (collective: every rank calls it)."""
    folder = directory / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    plan = executor.plan
    for stage in executor.stage_ids:  # every replica: gathering ZeRO shards is collective
        payload = {"step": step, "stage": stage, "fingerprint": plan.model.fingerprint,
                   **stage_state(executor, stage), "stashed": executor.versions.stashed(stage, step)}
        if executor.replica == 0:
            _atomic(folder / f"stage-{stage}.pt", lambda handle, p=payload: torch.save(p, handle))
        del payload
    dist.barrier()
    if executor.rank == 0:
        latest = {"step": step, "fingerprint": plan.model.fingerprint, "split": split_digest(plan),
                  "stage_starts": [stage.nodes[0] for stage in plan.stages]}
        _atomic(directory / "latest.json", lambda handle: handle.write(json.dumps(latest).encode()))
    dist.barrier()


def latest(directory: Path) -> Latest | None:
    """The newest complete checkpoint in ``directory``, or None if there is none (or no directory)."""
    path = directory / "latest.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return Latest(int(data["step"]), str(data["fingerprint"]), data.get("split"),
                      tuple(data.get("stage_starts", ())))
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is corrupt ({error}); delete it to start over",
                              same_on_every_rank=True) from error


def check_resumable(saved: Latest, plan: Plan, steps: int, directory: Path) -> None:
    """Refuse, alike on every rank, a checkpoint of another model or cut, or with nothing left to train."""
    def refuse(reason: str) -> CheckpointError:
        return CheckpointError(f"cannot resume from {directory}: {reason}", same_on_every_rank=True)

    if saved.fingerprint != plan.model.fingerprint:
        raise refuse(f"its checkpoint is of another model (graph fingerprint {saved.fingerprint[:16]}..., "
                     f"this plan's {plan.model.fingerprint[:16]}...); resume with the plan that wrote "
                     f"it, or use another --checkpoint-dir")
    if saved.split is not None and saved.split != split_digest(plan):
        starts = [stage.nodes[0] for stage in plan.stages]
        raise refuse(f"its checkpoint was written by a plan that cuts the model into "
                     f"{len(saved.stage_starts)} stages starting at {list(saved.stage_starts)}, but "
                     f"this plan's {len(starts)} stages start at {starts}; resume with the plan that "
                     f"wrote it, or use another --checkpoint-dir")
    if saved.step >= steps:
        raise refuse(f"its newest checkpoint is at step {saved.step}, so --steps {steps} leaves nothing "
                     f"to train; pass --steps above {saved.step} to train on from it, or use another "
                     f"--checkpoint-dir to start over")


def restore(executor: Executor, directory: Path, step: int) -> int:
    """Load this rank's stages from the checkpoint of ``step``; returns the step."""
    for stage in executor.stage_ids:
        path = directory / f"step-{step:08d}" / f"stage-{stage}.pt"
        saved = _load(path, executor.device)
        if saved.get("fingerprint") != executor.plan.model.fingerprint or saved.get("stage") != stage:
            raise CheckpointError(f"{path} belongs to another model or stage (fingerprint "
                                  f"{str(saved.get('fingerprint'))[:12]}..., stage {saved.get('stage')}); "
                                  f"resume with the plan that wrote it or use another --checkpoint-dir")
        load_stage_state(executor, stage, saved)
        if stage in executor.versions.stale_stages:
            _resume_stashed(executor, stage, step, saved, directory)
    executor.steps_done = step
    return step


def stage_state(executor: Executor, stage: int) -> dict[str, Any]:
    """The stage's parameters and buffers (by model name), its optimizer's full state dict, and under
    mixed precision its fp32 masters and the loss scale (collective for a ZeRO stage: every replica
    calls it)."""
    local = executor.stages[stage]
    tensors = stage_state_tensors(executor.model, local)
    precision = executor.mixed.state_dict(stage) if executor.mixed is not None else None
    if local.state is None:
        return {"model": {name: t.detach() for name, t in tensors.items()}, "optimizer": None,
                "precision": precision}
    with local.state.params_gathered():
        model = {name: t.detach().clone() for name, t in tensors.items()}
    return {"model": model, "optimizer": local.state.full_optimizer_state(), "precision": precision}


def load_stage_state(executor: Executor, stage: int, saved: dict[str, Any]) -> None:
    local = executor.stages[stage]
    tensors = stage_state_tensors(executor.model, local)
    if set(saved["model"]) != set(tensors):
        written, wanted = set(saved["model"]), set(tensors)
        extra, missing = sorted(written - wanted), sorted(wanted - written)
        raise CheckpointError(f"stage {stage}'s checkpoint was written for another plan: it holds "
                              f"{len(extra)} tensors this stage lacks (first {extra[0] if extra else '-'}) "
                              f"and lacks {len(missing)} it has (first {missing[0] if missing else '-'}); "
                              f"resume with the plan that wrote it, or use another --checkpoint-dir")
    masters = None
    if executor.mixed is not None:
        masters = executor.mixed.load_state_dict(stage, saved.get("precision"))
    elif saved.get("precision") is not None:
        raise CheckpointError(f"stage {stage}'s checkpoint was written in mixed precision "
                              f"({saved['precision'].get('precision')}) but this plan trains in "
                              f"{executor.plan.model.precision.value}; resume with the plan that wrote it, "
                              f"or use another --checkpoint-dir")
    state = local.state
    with state.params_gathered() if state is not None else contextlib.nullcontext(), torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(saved["model"][name])
        if state is not None:  # the masters follow the loaded parameters or the saved fp32 masters
            try:
                state.restore(saved["optimizer"], masters)  # (collective under ZeRO-3)
            except ValueError as error:  # torch's: its optimizer steps other parameters than the saved one
                raise CheckpointError(
                    f"stage {stage}'s optimizer state was written for another plan ({describe_error(error)}): "
                    f"this one places the stage's weights otherwise (e.g. a tied weight on a rank holding two "
                    f"of its stages); resume with the plan that wrote it, or use another --checkpoint-dir",
                    same_on_every_rank=False) from error


def _resume_stashed(executor: Executor, stage: int, step: int, saved: dict[str, Any], directory: Path) -> None:
    """A stage on stashed weight versions continues from the version its checkpoint saved (every rank of a
    WPipe plan holds such a stage, so every rank refuses a checkpoint without them alike)."""
    stashed = saved.get("stashed")
    if stashed is None:
        raise CheckpointError(f"the checkpoint of step {step} in {directory} holds no stashed weight versions: it "
                              f"was written by a plan that steps every stage synchronously, and this "
                              f"{executor.plan.schedule.kind.value} plan computes its first group of stages on "
                              f"weights one update old; resume with the plan that wrote it, or use another "
                              f"--checkpoint-dir", same_on_every_rank=True)
    try:
        executor.versions.resume(stage, step, stashed)
    except ValueError as error:
        raise CheckpointError(f"stage {stage}'s checkpoint was written for another plan ({error}); resume with the "
                              f"plan that wrote it, or use another --checkpoint-dir") from error


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
