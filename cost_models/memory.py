"""Bytes of model state (weights, gradients, optimizer state) and activations by precision."""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.errors import InvalidArgument

_FLOAT_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Precision:
    """How training stores numbers: the compute dtype and whether fp32 master weights exist.

    ``fp16``/``bf16`` mean mixed precision: 2-byte weights, gradients and activations, plus
    fp32 master weights and fp32 optimizer state (the layout of the ZeRO papers: 16 bytes per
    parameter with Adam).
    """

    name: str
    itemsize: int
    master_weights: bool
    state_itemsize: int


PRECISIONS = {
    "fp64": Precision("fp64", 8, False, 8),
    "fp32": Precision("fp32", 4, False, 4),
    "fp16": Precision("fp16", 2, True, 4),
    "bf16": Precision("bf16", 2, True, 4),
}

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "sgd-momentum": 1, "adam": 2, "adamw": 2}
"""Optimizer state tensors kept per parameter tensor."""


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name.lower()]
    except (KeyError, AttributeError):
        raise InvalidArgument(f"unknown precision {name!r}; choose one of "
                              f"{', '.join(PRECISIONS)} (fp16/bf16 mean mixed precision with fp32 "
                              f"master weights)") from None


def optimizer_state_count(optimizer: str) -> int:
    try:
        return OPTIMIZER_STATES[optimizer.lower()]
    except (KeyError, AttributeError):
        raise InvalidArgument(f"unknown optimizer {optimizer!r}; choose one of "
                              f"{', '.join(OPTIMIZER_STATES)}") from None


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes one set of parameters needs for weights, gradients and optimizer state."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def model_state_bytes(numel: int, precision: Precision, optimizer: str) -> ModelStateBytes:
    """Weights and gradients in the training dtype; fp32 master copy and optimizer states."""
    states = optimizer_state_count(optimizer)
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
