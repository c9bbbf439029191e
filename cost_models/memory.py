"""Bytes of model state (weights, gradients, optimizer state) and activations by precision."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from cost_models.errors import InvalidArgument

_FLOAT_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


class Precision(str, Enum):
    """How training stores numbers: the compute dtype and whether fp32 master weights exist.

    ``fp16``/``bf16`` mean mixed precision: 2-byte weights, gradients and activations, plus
    fp32 master weights and fp32 optimizer state (the layout of the ZeRO papers: 16 bytes per
    parameter with Adam).
    """

    FP64 = "fp64"
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def itemsize(self) -> int:
        """Bytes of one weight, gradient or activation element."""
        return {"fp64": 8, "fp32": 4}.get(self.value, 2)

    @property
    def master_weights(self) -> bool:
        """Mixed precision keeps an fp32 master copy of the weights."""
        return self.value in ("fp16", "bf16")

    @property
    def state_itemsize(self) -> int:
        """Bytes of one optimizer-state (and master-weight) element."""
        return 8 if self is Precision.FP64 else 4

    @property
    def loss_itemsize(self) -> int:
        """Bytes of one element the loss computes on: mixed precision casts the 16-bit output up to fp32
        first (runtime/precision.py), as it keeps master weights in fp32."""
        return self.state_itemsize

    @property
    def dtype(self) -> str:
        """The torch dtype name of weights and activations (``getattr(torch, p.dtype)``)."""
        return {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[self.value]


class Optimizer(str, Enum):
    """The optimizers tessera costs and the runtime builds; the value is how plans and the CLI name it."""

    SGD = "sgd"
    MOMENTUM = "momentum"  # SGD with momentum 0.9
    ADAM = "adam"
    ADAMW = "adamw"

    @classmethod
    def _missing_(cls, value: object) -> Optimizer | None:
        return cls.MOMENTUM if value == "sgd-momentum" else None

    @property
    def state_count(self) -> int:
        """Optimizer state tensors kept per parameter tensor."""
        return {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}[self.value]

    @property
    def step_temporaries(self) -> int:
        """Temporaries per stepped element, in the state's dtype, that torch's multi-tensor step allocates:
        Adam's and AdamW's denominator (the second moment's square root); SGD updates in place."""
        return {"sgd": 0, "momentum": 0, "adam": 1, "adamw": 1}[self.value]

    def build(self, params: list, lr: float) -> Any:
        """The torch optimizer this name means over ``params`` (momentum: SGD with momentum 0.9); what the
        runtime steps and what the measured devices time."""
        import torch

        if self is Optimizer.SGD:
            return torch.optim.SGD(params, lr=lr)
        if self is Optimizer.MOMENTUM:
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        if self is Optimizer.ADAM:
            return torch.optim.Adam(params, lr=lr)
        return torch.optim.AdamW(params, lr=lr)


def get_precision(name: str | Precision) -> Precision:
    """The precision named ``name`` (case-insensitive), or InvalidArgument listing the choices."""
    try:
        return Precision(name.lower() if isinstance(name, str) else name)
    except (ValueError, AttributeError):
        raise InvalidArgument(f"unknown precision {name!r}; choose one of "
                              f"{', '.join(p.value for p in Precision)} (fp16/bf16 mean mixed precision "
                              f"with fp32 master weights)") from None


def get_optimizer(name: str | Optimizer) -> Optimizer:
    """The optimizer named ``name`` (case-insensitive), or InvalidArgument listing the choices."""
    try:
        return Optimizer(name.lower() if isinstance(name, str) else name)
    except (ValueError, AttributeError):
        raise InvalidArgument(f"unknown optimizer {name!r}; choose one of "
                              f"{', '.join(o.value for o in Optimizer)}") from None


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes one set of parameters needs for weights, gradients and optimizer state."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def model_state_bytes(numel: int, precision: Precision, optimizer: Optimizer) -> ModelStateBytes:
    """Weights and gradients in the training dtype; fp32 master copy and optimizer states."""
    states = optimizer.state_count
    master = precision.state_itemsize if precision.master_weights else 0
    return ModelStateBytes(numel * precision.itemsize, numel * precision.itemsize,
                           numel * (master + states * precision.state_itemsize))


def activation_bytes(saved_bytes_by_dtype: tuple[tuple[str, int], ...], precision: Precision) -> int:
    """Rescale floating-point saved bytes to the training dtype; integer/bool bytes are kept."""
    return sum(rescale_bytes(nbytes, dtype, precision) for dtype, nbytes in saved_bytes_by_dtype)


def rescale_bytes(nbytes: int, dtype: str, precision: Precision) -> int:
    """``nbytes`` of a tensor of ``dtype`` once stored in the training precision."""
    itemsize = _FLOAT_ITEMSIZE.get(dtype)
    return nbytes if itemsize is None else nbytes * precision.itemsize // itemsize


def step_bucket_bytes(grad_bytes: int) -> int:
    """The gradient bytes one bucket of a stage's optimizer step takes (runtime/stage_optimizer.py), for a
    stage with ``grad_bytes`` of gradients: an eighth of them, between 1 MiB and 64 MiB, so that what the
    step itself allocates stays a small share of what the stage holds, and a large stage's buckets stay few.
    A parameter larger than that is a bucket of its own.

    >>> step_bucket_bytes(4 * 2**20) == 2**20, step_bucket_bytes(80 * 2**20) == 10 * 2**20
    (True, True)
    >>> step_bucket_bytes(2**40) == 2**26
    True
    """
    return min(max(grad_bytes // 8, 2**20), 64 * 2**20)


def shard_numel(numel: int, copies: int) -> int:
    """Elements of one replica's shard of a parameter of ``numel`` elements sharded over ``copies`` replicas
    (ZeRO; runtime/sharding.py pads the last shard to this size).

    >>> shard_numel(10, 4), shard_numel(8, 4)
    (3, 2)
    """
    return -(-numel // copies)


def step_buckets(sizes: Sequence[int | None], limit: int) -> list[list[int]]:
    """The buckets of an optimizer step (runtime/stage_optimizer.py steps them; planner/stepped.py predicts
    them): consecutive indices of the sizes given (None: skipped), grouped so that no group's sizes add up
    to more than ``limit``, unless one size alone does: that one is a group of its own.

    >>> step_buckets([3, None, 3, 5, 1], 6)
    [[0, 2], [3, 4]]
    >>> step_buckets([2, 9, 2], 6)
    [[0], [1], [2]]
    """
    groups: list[list[int]] = [[]]
    total = 0
    for index, size in enumerate(sizes):
        if size is None:
            continue
        if groups[-1] and total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(index)
        total += size
    return [group for group in groups if group]


def step_transient_bytes(bucket_numel: float, precision: Precision, optimizer: Optimizer, *,
                         separate_masters: bool, steps_on_device: bool, freed_numel: float | None = None) -> float:
    """Device bytes an optimizer step allocates beyond the model state (every gradient still held), at its
    worst moment, when it steps a bucket of ``bucket_numel`` elements (runtime/stage_optimizer.py).

    * ``separate_masters`` (mixed precision, ZeRO shards, an optimizer off the device): the bucket's
      gradients are first copied into one buffer in the masters' dtype, on the device (off it, the cast
      runs on the device before the copy down); then the bucket's gradients are freed: ``freed_numel``
      elements in the weights' dtype (default the bucket's; under ZeRO-1 its shards are views of whole
      gradients, all freed).
    * ``steps_on_device``: torch's multi-tensor Adam and AdamW allocate one temporary per element of the
      bucket (the denominator, the second moment's square root); SGD with or without momentum none.

    >>> step_transient_bytes(1000, Precision.BF16, Optimizer.ADAM, separate_masters=True, steps_on_device=True)
    6000
    >>> step_transient_bytes(1000, Precision.FP32, Optimizer.ADAM, separate_masters=False, steps_on_device=True)
    4000
    """
    master = bucket_numel * precision.state_itemsize
    temporaries = master * optimizer.step_temporaries if steps_on_device else 0.0
    if not separate_masters:
        return temporaries
    freed = (bucket_numel if freed_numel is None else freed_numel) * precision.itemsize
    return master + max(0.0, temporaries - freed)


def zero_gather_bytes(bucket_numel: float, precision: Precision, copies: int, *, masters_off_device: bool,
                      freed_numel: float | None = None, staging: int = 0) -> float:
    """Device bytes beyond the model state (every gradient counted) that ZeRO-1/2's all-gather of one stepped
    bucket holds (runtime/stage_optimizer.py), for a bucket of ``bucket_numel`` elements of this rank's
    shards over ``copies`` replicas: every replica's shards (the bucket's whole weights; ``staging`` more
    such buffers where the backend gathers through its own: cost_models.comm.ALL_GATHER_STAGING) and this
    rank's row sent, in the weights' dtype, and the shards cast to it first where the masters are not
    already it on the device; less the bucket's gradients, freed by then (``freed_numel`` as for
    :func:`step_transient_bytes`).

    >>> zero_gather_bytes(1000, Precision.BF16, 4, masters_off_device=False)
    10000
    """
    cast = precision.master_weights or masters_off_device
    freed = bucket_numel if freed_numel is None else freed_numel
    return int(precision.itemsize * (bucket_numel * (copies * (1 + staging) + 1 + cast) - freed))
