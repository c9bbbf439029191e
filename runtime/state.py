"""What the executor holds during one step: per (stage, micro-batch) values, gradients and losses."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.microbatch import Microbatch


@dataclass
class MicrobatchState:
    """One stage's view of one micro-batch, from its forward until its backward has sent everything."""

    env: dict[str, Any] = field(default_factory=dict)  # values by node name: inputs and outputs
    roots: dict[str, torch.Tensor] = field(default_factory=dict)  # outputs whose gradients come back
    loss: torch.Tensor | None = None  # scaled loss (last stage)
    output_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # received for roots
    input_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # to send to producers

    def tensors(self) -> Iterator[torch.Tensor]:
        for group in (self.env.values(), self.roots.values(), self.output_grads.values(),
                      self.input_grads.values()):
            yield from (value for value in group if isinstance(value, torch.Tensor))
        if self.loss is not None:
            yield self.loss


@dataclass
class StepState:
    """Everything one step's actions read and write on this rank."""

    microbatches: tuple[Microbatch, ...]
    by_key: dict[tuple[int, int], MicrobatchState] = field(default_factory=dict)
    inbox: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # before a stage's F
    losses: list[torch.Tensor] = field(default_factory=list)  # unscaled, one per micro-batch
    tied_synced: bool = False

    def micro(self, stage: int, microbatch: int) -> MicrobatchState:
        return self.by_key.setdefault((stage, microbatch), MicrobatchState())

    def mailbox(self, stage: int, microbatch: int) -> dict[str, Any]:
        return self.inbox.setdefault((stage, microbatch), {})

    def held(self) -> Iterator[torch.Tensor]:
        """Every tensor this state references (for memory accounting)."""
        for micro in self.by_key.values():
            yield from micro.tensors()
        for box in self.inbox.values():
            yield from (value for value in box.values() if isinstance(value, torch.Tensor))
