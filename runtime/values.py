"""Values that cross stages, per micro-batch: their specs (from a fake run) and their wire form.

Tensors travel as they are. Python scalars and int tuples (e.g. a ``size()`` computed on one
stage and used on the next) travel as small int64/float64/bool tensors. Devices, dtypes and
``None`` never travel: the receiver uses the constant found at set-up (a device becomes the
receiving rank's own device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.fx

from cost_models.errors import RuntimeSetupError
from cost_models.graph.shapes import SCALAR_WIRE_DTYPES, crosses_boundary, propagate


class ValueKind(str, Enum):
    TENSOR = "tensor"
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"
    INTS = "ints"  # a tuple of ints, e.g. torch.Size
    CONSTANT = "constant"  # device, dtype, None: known at set-up, never sent
    OTHER = "other"  # cannot cross a stage boundary


_SCALAR_DTYPES = {ValueKind.INT: SCALAR_WIRE_DTYPES[int], ValueKind.FLOAT: SCALAR_WIRE_DTYPES[float],
                  ValueKind.BOOL: SCALAR_WIRE_DTYPES[bool]}


@dataclass(frozen=True)
class ValueSpec:
    """One fx node's value for one micro-batch: kind, and for tensors shape, dtype and requires_grad."""

    name: str
    kind: ValueKind
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    requires_grad: bool = False
    constant: Any = None

    @property
    def carries_grad(self) -> bool:
        """Whether a gradient comes back for this value when it crosses stages."""
        return self.kind is ValueKind.TENSOR and self.requires_grad

    @property
    def travels(self) -> bool:
        return self.kind not in (ValueKind.CONSTANT, ValueKind.OTHER)

    def empty(self, device: torch.device) -> torch.Tensor:
        """A receive buffer for the wire form of this value."""
        if self.kind is ValueKind.TENSOR:
            return torch.empty(self.shape, dtype=self.dtype, device=device)
        if self.kind is ValueKind.INTS:
            return torch.empty(self.shape, dtype=torch.int64, device=device)
        return torch.empty((), dtype=_SCALAR_DTYPES[self.kind], device=device)

    def encode(self, value: Any, device: torch.device) -> torch.Tensor:
        """The wire tensor for ``value`` (checked against the spec)."""
        if self.kind is ValueKind.TENSOR:
            if tuple(value.shape) != self.shape or value.dtype != self.dtype:
                raise RuntimeError(f"value {self.name} is {tuple(value.shape)} {value.dtype} but the "
                                   f"plan's micro-batch shape gives {self.shape} {self.dtype}")
            return value.detach().contiguous()
        if self.kind is ValueKind.INTS:
            return torch.tensor(list(value), dtype=torch.int64, device=device)
        return torch.tensor(value, dtype=_SCALAR_DTYPES[self.kind], device=device)

    def decode(self, wire: torch.Tensor | None, device: torch.device) -> Any:
        """The value a receiving stage computes with."""
        if self.kind is ValueKind.CONSTANT:
            return device if isinstance(self.constant, torch.device) else self.constant
        assert wire is not None
        if self.kind is ValueKind.TENSOR:
            return wire.requires_grad_(self.requires_grad)
        if self.kind is ValueKind.INTS:
            return torch.Size(wire.tolist())
        return wire.item()


def value_specs(module: torch.fx.GraphModule, inputs: Sequence[tuple[tuple[int, ...], torch.dtype]],
                microbatch_size: int) -> dict[str, ValueSpec]:
    """Run ``module`` on fake inputs of ``microbatch_size`` and describe every node's value.

    ``inputs`` are (shape with any batch size, dtype) per placeholder; parameters may be on
    the meta device or real (they are not modified: the run reads fake copies).
    """
    device = next((t.device for t in module.parameters()), torch.device("cpu"))
    shapes = [torch.empty((microbatch_size, *shape[1:]), dtype=dtype, device="meta")
              for shape, dtype in inputs]
    return {name: describe(name, value) for name, value in propagate(module, shapes, device).items()}


def describe(name: str, value: Any) -> ValueSpec:
    if not crosses_boundary(value):  # the planner cuts by the same rule (LayerNode.crosses)
        return ValueSpec(name, ValueKind.OTHER, constant=type(value).__name__)
    if isinstance(value, torch.Tensor):
        return ValueSpec(name, ValueKind.TENSOR, tuple(value.shape), value.dtype,
                         value.requires_grad and value.is_floating_point())
    if isinstance(value, bool):
        return ValueSpec(name, ValueKind.BOOL)
    if isinstance(value, int):
        return ValueSpec(name, ValueKind.INT)
    if isinstance(value, float):
        return ValueSpec(name, ValueKind.FLOAT)
    if isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return ValueSpec(name, ValueKind.INTS, (len(value),))
    return ValueSpec(name, ValueKind.CONSTANT, constant=value)  # None, a device or a dtype


def check_travels(spec: ValueSpec, src_stage: int, dst_stage: int) -> None:
    if spec.kind is ValueKind.OTHER:
        raise RuntimeSetupError(
            f"node {spec.name} produces a {spec.constant}, which cannot be sent from stage "
            f"{src_stage} to stage {dst_stage}; only tensors, Python scalars, int tuples, devices "
            f"and dtypes can cross a stage boundary. Re-plan with a cut elsewhere (e.g. "
            f"plan_with_split with stage_starts after {spec.name}'s users)")
