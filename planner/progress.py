"""Progress of a planning run: the events plan() passes to an optional callback (the CLI prints them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from cost_models.units import format_ms


class Phase(str, Enum):
    TRACING = "tracing"
    COSTING = "costing"
    SEARCHING = "searching"
    ASSEMBLING = "assembling"


@dataclass(frozen=True)
class ProgressEvent:
    """Where a planning run is: its phase and, while searching, configurations done and the incumbent.

    ``best_ms`` is the best ILP objective found so far (the final plan reports its simulated step).
    """

    phase: Phase
    done: int = 0
    total: int = 0
    best_ms: float | None = None
    detail: str = ""

    def describe(self) -> str:
        """``searching 3/12 configurations, best so far 31.65 s (ILP): solving 16 stages x 1 ...``"""
        text = self.phase.value
        if self.total:
            text += f" {self.done}/{self.total} configurations"
        if self.best_ms is not None:
            text += f", best so far {format_ms(self.best_ms)} (ILP)"
        return f"{text}: {self.detail}" if self.detail else text


Progress = Callable[[ProgressEvent], None]
"""A receiver of progress events; plan() reports nothing when none is given."""
