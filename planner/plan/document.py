"""The Plan: one partition decision as frozen data with a versioned, exact JSON file (never pickled).

Schema 2 stores the layout (which ranks run which stage) explicitly; schema-1 files are upgraded
on load (planner/plan/upgrade.py). Decoding fails closed: an unknown field, a missing one, a
value of the wrong type or one breaking an invariant (a count below 1, sizes that disagree) is a
PlanFileError naming its path.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cost_models.errors import PlanFileError
from planner.plan import codec
from planner.plan.invariants import check_invariants
from planner.plan.layout import Layout, layout_from_dict
from planner.plan.parts import (
    ClusterSpec,
    LayerRow,
    ModelRef,
    Prediction,
    ScheduleSpec,
    SolverReport,
    StagePlan,
    TiedSum,
    TrainingSpec,
    Transfer,
)
from planner.plan.text import format_plan
from planner.plan.upgrade import SCHEMA_VERSION, upgrade


@dataclass(frozen=True)
class Plan:
    """A partition decision: what each stage computes, where it runs, programs, predictions, and why.

    ``stages[p]`` is part p (its nodes and predicted costs); ``layout`` maps every stage of the
    schedule and every data-parallel replica to its ranks; ``programs[rank]`` is that rank's
    action list.

    Example::

        p = plan(model, gpus=16, mem="16GB", batch_size=32, example_inputs=x)
        print(p); p.save("plan.json"); assert Plan.load("plan.json") == p
    """

    model: ModelRef
    cluster: ClusterSpec
    training: TrainingSpec
    schedule: ScheduleSpec
    layout: Layout
    stages: tuple[StagePlan, ...]
    layers: tuple[LayerRow, ...]
    programs: tuple[tuple[str, ...], ...]  # per rank, the lowered actions ("2F5", "2SEND_F5>3")
    transfers: tuple[Transfer, ...]
    predicted: Prediction
    solver: SolverReport
    tied_sums: tuple[TiedSum, ...] = ()  # absent in older files (their replay leaves the sums out)
    schema_version: int = SCHEMA_VERSION

    @property
    def num_stages(self) -> int:
        """Stages of the schedule (each runs one part; usually stage s runs part s)."""
        return self.layout.num_stages

    @property
    def num_parts(self) -> int:
        return len(self.stages)

    @property
    def data_parallel(self) -> int:
        return self.layout.data_parallel

    def part_of(self) -> dict[str, int]:
        """Node name -> the part (index into ``stages``) that computes it."""
        return {name: stage.index for stage in self.stages for name in stage.nodes}

    def to_dict(self) -> dict[str, Any]:
        return codec.encode(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Decode (failing closed on a field of the wrong type), then check planner/plan/invariants.py."""
        try:
            plan = _decode(upgrade(data))
        except ValueError as error:
            raise PlanFileError(f"plan data is malformed: {error}; re-create it with `tessera plan`"
                                ) from None
        check_invariants(plan)
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        """Write atomically: a failure never leaves a half-written or clobbered plan file."""
        target = Path(path)
        try:
            handle, tmp = tempfile.mkstemp(dir=target.parent or Path("."), prefix=f".{target.name}.")
        except OSError as error:
            raise PlanFileError(f"cannot write the plan to {str(path)!r}: {error.strerror} in its folder; "
                                f"give a path in a writable folder") from error
        try:
            with os.fdopen(handle, "w") as out:
                out.write(self.to_json())
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, target)
        except OSError as error:
            Path(tmp).unlink(missing_ok=True)
            raise PlanFileError(f"cannot write the plan to {str(path)!r}: {error.strerror}; give a file path "
                                f"in a writable folder") from error
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise PlanFileError(f"cannot read plan file {str(path)!r}: {error.strerror}") from error
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanFileError(f"plan file {str(path)!r} is not valid JSON ({error}); it may be "
                                f"truncated or corrupt: re-create it with `tessera plan`") from error
        return cls.from_dict(data)

    def __str__(self) -> str:
        return format_plan(self.model, self.cluster, self.training, self.schedule, self.layout, self.stages,
                           self.predicted, self.solver, self.tied_sums)


def _decode(data: Mapping[str, Any]) -> Plan:
    return codec.fields(Plan, data, "", {
        "schema_version": codec.integer, "model": ModelRef.from_dict, "cluster": ClusterSpec.from_dict,
        "training": TrainingSpec.from_dict, "schedule": ScheduleSpec.from_dict, "layout": layout_from_dict,
        "stages": codec.tuple_of(StagePlan.from_dict), "layers": codec.tuple_of(LayerRow.from_dict),
        "programs": codec.tuple_of(codec.tuple_of(codec.string)),
        "transfers": codec.tuple_of(Transfer.from_dict),
        "predicted": Prediction.from_dict, "solver": SolverReport.from_dict,
        "tied_sums": codec.tuple_of(TiedSum.from_dict)}, optional=frozenset({"tied_sums"}))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
