"""The Plan: frozen dataclasses with a versioned, exact JSON codec (never pickled).

Reading a plan imports the standard library only, so the runtime and `tessera show` stay cheap.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from cost_models.errors import PlanFileError

SCHEMA_VERSION = 1


class ScheduleKind(str, Enum):
    """Pipeline schedules a plan can name."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    WPIPE = "wpipe"
    GEMS_MASTER = "gems-master"


@dataclass(frozen=True)
class InputMeta:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ModelRef:
    """How the runtime rebuilds the model and checks it is the one that was planned."""

    builder: str | None
    builder_kwargs: Mapping[str, Any]
    fingerprint: str
    example_inputs: tuple[InputMeta, ...]
    precision: str


@dataclass(frozen=True)
class ClusterSpec:
    gpus: int
    gpus_per_node: int
    device: Mapping[str, Any]  # DeviceSpec.to_dict(): name, mem_bytes, links, ...
    mem_bytes: int  # the per-GPU budget the plan was made for

    @property
    def device_name(self) -> str:
        return str(self.device["name"])


@dataclass(frozen=True)
class TrainingSpec:
    global_batch_size: int
    micro_batch_size: int
    num_microbatches: int
    optimizer: str


@dataclass(frozen=True)
class ScheduleSpec:
    kind: ScheduleKind
    virtual_stages: int = 1


@dataclass(frozen=True)
class OffloadSpec:
    """Per-node activation policy and where optimizer state and weights live."""

    activations: Mapping[str, str] = field(default_factory=dict)  # node -> keep|host|recompute
    optimizer_state: str = "gpu"  # gpu|host|nvme
    params: str = "gpu"  # gpu|host


@dataclass(frozen=True)
class StagePrediction:
    """Per micro-batch times; memory at the peak of the schedule (``in_flight`` micro-batches held)."""

    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    activation_bytes: int  # in_flight x (saved activations + received inputs) per micro-batch
    peak_mem_bytes: int
    in_flight: int = 1
    allreduce_ms: float = 0.0

    @property
    def static_bytes(self) -> int:
        """Held the whole step: weights, gradients, optimizer state, buffers, transient, send buffer."""
        return self.peak_mem_bytes - self.activation_bytes


@dataclass(frozen=True)
class Transfer:
    """Activations one stage sends another per micro-batch (gradients return the same size)."""

    src_stage: int
    dst_stage: int
    nbytes: int
    ms: float


@dataclass(frozen=True)
class StagePlan:
    index: int
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    predicted: StagePrediction
    spatial: Mapping[str, Any] | None = None
    offload: OffloadSpec = field(default_factory=OffloadSpec)


@dataclass(frozen=True)
class LayerRow:
    """One row of the cost table the solver used (per micro-batch)."""

    name: str
    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    saved_activation_bytes: int
    output_bytes: int


@dataclass(frozen=True)
class Prediction:
    step_ms: float
    samples_per_s: float
    bubble_fraction: float
    peak_mem_bytes: tuple[int, ...]  # per rank


@dataclass(frozen=True)
class SolverReport:
    name: str
    status: str
    objective: float
    gap: float
    wall_s: float
    configs_tried: int
    why: str
    binding: str = ""
    runner_up: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Plan:
    """A partition decision: stages, schedule, programs, predictions and how it was found.

    Example::

        p = plan(model, gpus=16, mem="16GB", batch_size=32, example_inputs=x)
        print(p); p.save("plan.json"); assert Plan.load("plan.json") == p
    """

    model: ModelRef
    cluster: ClusterSpec
    training: TrainingSpec
    schedule: ScheduleSpec
    data_parallel: int
    stages: tuple[StagePlan, ...]
    layers: tuple[LayerRow, ...]
    programs: tuple[tuple[str, ...], ...]  # per rank, the lowered actions ("2F5", "2SEND_F5>3")
    transfers: tuple[Transfer, ...]
    predicted: Prediction
    solver: SolverReport
    schema_version: int = SCHEMA_VERSION

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of(self) -> dict[str, int]:
        """Node name -> stage index."""
        return {name: stage.index for stage in self.stages for name in stage.nodes}

    def to_dict(self) -> dict[str, Any]:
        return _encode(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        version = data.get("schema_version") if isinstance(data, Mapping) else None
        if version != SCHEMA_VERSION:
            raise PlanFileError(f"plan schema_version is {version!r} but this tessera reads "
                                f"version {SCHEMA_VERSION}; re-create the plan with `tessera plan`")
        try:
            return _decode(cls, data)
        except (KeyError, TypeError, ValueError) as error:
            raise PlanFileError(f"plan data is malformed ({type(error).__name__}: {error}); "
                                f"re-create it with `tessera plan`") from error

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        """Write atomically: a failure never leaves a half-written or clobbered plan file."""
        target = Path(path)
        handle, tmp = tempfile.mkstemp(dir=target.parent or Path("."), prefix=f".{target.name}.")
        try:
            with os.fdopen(handle, "w") as out:
                out.write(self.to_json())
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
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
        from planner.plan.text import format_plan

        return format_plan(self)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


def _decode(kind: Any, data: Any) -> Any:
    """Rebuild ``kind`` (a dataclass or typing annotation string) from JSON data."""
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints = {f.name: f.type for f in dataclasses.fields(kind)}
        unknown = set(data) - set(hints)
        if unknown:
            raise ValueError(f"unknown {kind.__name__} fields {sorted(unknown)}")
        return kind(**{name: _decode(_TYPES.get(hint, hint), data[name])
                       for name, hint in hints.items() if name in data})
    return kind(data) if callable(kind) else data


def _tuple_of(item: Any) -> Any:
    return lambda values: tuple(_decode(item, v) for v in values)


def freeze(value: Any) -> Any:
    """JSON-like data made immutable: dicts become read-only mappings, lists become tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def _frozen_mapping(values: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(values, Mapping):
        raise TypeError(f"expected an object, got {type(values).__name__}")
    return freeze(values)


_TYPES: dict[str, Any] = {
    "int": int, "float": float, "str": str,
    "str | None": lambda v: v, "Mapping[str, Any]": _frozen_mapping,
    "Mapping[str, Any] | None": lambda v: None if v is None else _frozen_mapping(v),
    "Mapping[str, str]": _frozen_mapping,
    "tuple[int, ...]": _tuple_of(int),
    "tuple[str, ...]": _tuple_of(str),
    "tuple[tuple[str, ...], ...]": _tuple_of(_tuple_of(str)),
    "tuple[InputMeta, ...]": _tuple_of(InputMeta),
    "tuple[StagePlan, ...]": _tuple_of(StagePlan),
    "tuple[LayerRow, ...]": _tuple_of(LayerRow),
    "tuple[Transfer, ...]": _tuple_of(Transfer),
    "ScheduleKind": ScheduleKind,
    **{name: cls for name, cls in [("ModelRef", ModelRef), ("ClusterSpec", ClusterSpec),
                                   ("TrainingSpec", TrainingSpec), ("ScheduleSpec", ScheduleSpec),
                                   ("OffloadSpec", OffloadSpec), ("StagePrediction", StagePrediction),
                                   ("Prediction", Prediction), ("SolverReport", SolverReport)]},
}
