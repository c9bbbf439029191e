"""Split a global batch into this replica's micro-batches (inputs for stage 0, targets for the last)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cost_models.errors import InvalidArgument

Targets = Any  # a tensor, or a tuple/list of tensors, split along dimension 0


@dataclass(frozen=True)
class Microbatch:
    """One micro-batch: model inputs (None where this rank does not need them) and targets."""

    inputs: tuple[torch.Tensor, ...] | None
    targets: Targets | None


def split_batch(inputs: torch.Tensor | Sequence[torch.Tensor] | None, targets: Targets | None, *,
                global_batch_size: int, data_parallel: int, replica: int,
                num_microbatches: int) -> tuple[Microbatch, ...]:
    """Replica ``replica``'s slice of the global batch, cut into ``num_microbatches`` equal parts.

    >>> parts = split_batch(torch.arange(8), torch.arange(8), global_batch_size=8, data_parallel=2,
    ...                     replica=1, num_microbatches=2)
    >>> [p.inputs[0].tolist() for p in parts]
    [[4, 5], [6, 7]]
    """
    per_replica = global_batch_size // data_parallel
    size = per_replica // num_microbatches
    start = replica * per_replica
    tuple_inputs = None if inputs is None else (
        (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    for tensor in [*(tuple_inputs or ()), *_leaves(targets)]:
        if tensor.shape[0] != global_batch_size:
            raise InvalidArgument(f"a batch tensor has {tensor.shape[0]} rows (shape "
                                  f"{tuple(tensor.shape)}) but the plan's global batch is "
                                  f"{global_batch_size}; pass the whole global batch on every rank")
    return tuple(Microbatch(_slice(tuple_inputs, start + m * size, size),
                            _slice(targets, start + m * size, size))
                 for m in range(num_microbatches))


def _leaves(targets: Targets | None) -> list[torch.Tensor]:
    if targets is None:
        return []
    if isinstance(targets, torch.Tensor):
        return [targets]
    return [t for t in targets if isinstance(t, torch.Tensor)]


def _slice(value: Any, start: int, size: int) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value[start:start + size]
    return type(value)(_slice(v, start, size) for v in value)
