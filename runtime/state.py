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
    weight_groups: list[dict[str, Any]] | None = None  # what a split backward's I keeps for its W

    def tensors(self) -> Iterator[torch.Tensor]:
        for group in (self.env.values(), self.roots.values(), self.output_grads.values(),
                      self.input_grads.values()):
            yield from (value for value in group if isinstance(value, torch.Tensor))
        if self.loss is not None:
            yield self.loss


@dataclass
class StepState:
    """Everything one step's actions read and write on this rank.

    The step trains period ``period`` on ``microbatches``; a program that runs forwards ahead for the
    next period (planner/schedules/periods.py) names that period's micro-batch j ``M + j`` and reads
    its data from ``ahead``. What those forwards leave is :meth:`carry`-ed into the next step's state.
    """

    microbatches: tuple[Microbatch, ...]
    period: int = 0
    ahead: tuple[Microbatch, ...] = ()
    num_microbatches: int | None = None  # M (default: len(microbatches))
    by_key: dict[tuple[int, int], MicrobatchState] = field(default_factory=dict)
    inbox: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # before a stage's F
    losses: list[torch.Tensor] = field(default_factory=list)  # unscaled, one per micro-batch
    tied_synced: bool = False

    def __post_init__(self) -> None:
        if self.num_microbatches is None:
            self.num_microbatches = len(self.microbatches)

    def _split(self, microbatch: int) -> tuple[bool, int]:
        """(whether ``microbatch`` is the next period's, its index within its period)."""
        assert self.num_microbatches is not None
        ahead = microbatch >= self.num_microbatches
        return ahead, microbatch - self.num_microbatches if ahead else microbatch

    def data(self, microbatch: int) -> Microbatch:
        ahead, index = self._split(microbatch)
        return (self.ahead if ahead else self.microbatches)[index]

    def period_of(self, microbatch: int) -> int:
        """The period (step) a program's micro-batch trains in."""
        return self.period + self._split(microbatch)[0]

    def index_in_period(self, microbatch: int) -> int:
        return self._split(microbatch)[1]

    def carry(self) -> dict[str, dict[tuple[int, int], Any]]:
        """Take out what the ahead forwards left (micro-batch states and received values), keyed by their
        index in the next period."""
        moved: dict[str, dict[tuple[int, int], Any]] = {"by_key": {}, "inbox": {}}
        for name in moved:
            held = getattr(self, name)
            for stage, microbatch in [key for key in held if self._split(key[1])[0]]:
                moved[name][stage, self.index_in_period(microbatch)] = held.pop((stage, microbatch))
        return moved

    def adopt(self, carried: dict[str, dict[tuple[int, int], Any]]) -> None:
        """Take in what the previous step's ahead forwards left for this period (see :meth:`carry`)."""
        self.by_key.update(carried["by_key"])
        self.inbox.update(carried["inbox"])

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
