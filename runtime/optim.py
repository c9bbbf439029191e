"""Optimizers by the plan's name (``training.optimizer``), one per stage."""

from __future__ import annotations

import torch
from torch import nn

from cost_models.errors import InvalidArgument
from runtime.stages import OptimizerFactory

DEFAULT_LR = {"sgd": 0.01, "momentum": 0.01, "sgd-momentum": 0.01, "adam": 1e-3, "adamw": 1e-3}


def optimizer_factory(name: str, lr: float | None = None) -> OptimizerFactory:
    """``factory(params)`` for the plan's optimizer: sgd, momentum (SGD, 0.9), adam or adamw.

    >>> opt = optimizer_factory("momentum", 0.1)([torch.nn.Parameter(torch.zeros(2))])
    >>> type(opt).__name__, opt.defaults["momentum"]
    ('SGD', 0.9)
    """
    key = name.lower()
    if key not in DEFAULT_LR:
        raise InvalidArgument(f"the plan's optimizer {name!r} is not one the runtime builds; "
                              f"choose one of {', '.join(DEFAULT_LR)}")
    rate = DEFAULT_LR[key] if lr is None else lr

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if key == "sgd":
            return torch.optim.SGD(params, lr=rate)
        if key in ("momentum", "sgd-momentum"):
            return torch.optim.SGD(params, lr=rate, momentum=0.9)
        if key == "adam":
            return torch.optim.Adam(params, lr=rate)
        return torch.optim.AdamW(params, lr=rate)

    return make
