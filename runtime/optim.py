"""Optimizers by the plan's name (``training.optimizer``), one per stage."""

from __future__ import annotations

import torch
from torch import nn

from cost_models.memory import Optimizer, get_optimizer
from runtime.stages import OptimizerFactory

DEFAULT_LR = {Optimizer.SGD: 0.01, Optimizer.MOMENTUM: 0.01, Optimizer.ADAM: 1e-3, Optimizer.ADAMW: 1e-3}


def optimizer_factory(name: str | Optimizer, lr: float | None = None) -> OptimizerFactory:
    """``factory(params)`` for the plan's optimizer: sgd, momentum (SGD, 0.9), adam or adamw.

    >>> opt = optimizer_factory("momentum", 0.1)([torch.nn.Parameter(torch.zeros(2))])
    >>> type(opt).__name__, opt.defaults["momentum"]
    ('SGD', 0.9)
    """
    kind = get_optimizer(name)
    rate = DEFAULT_LR[kind] if lr is None else lr

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return kind.build(params, rate)

    return make
