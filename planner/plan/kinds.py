"""The schedule kinds tessera generates, searches and runs: one enum, the registry's keys."""

from __future__ import annotations

from enum import Enum


class ScheduleKind(str, Enum):
    """A pipeline schedule family; the value is how plans and the command line name it.

    Every member has a generator in planner/schedules/generate.py (a test checks it), so no kind
    is advertised that cannot be planned and run.
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZB_H1 = "zb-h1"
    GEMS_MASTER = "gems-master"
    WPIPE = "wpipe"

    @classmethod
    def parse(cls, name: str | ScheduleKind) -> ScheduleKind:
        """The kind named ``name``, or ValueError listing the known kinds."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown schedule kind {name!r}; known kinds: "
                             f"{', '.join(kind.value for kind in cls)}") from None

    @property
    def closed_form(self) -> bool:
        """Whether the search's step model (planner/search/terms.py) writes this family's step in closed
        form; the others are costed from their own programs replayed on balanced parts
        (planner/schedules/balanced.py). The search considers every family.

        >>> [kind.value for kind in ScheduleKind if kind.closed_form]
        ['gpipe', '1f1b']
        """
        return self in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B)

    @property
    def stale_weights(self) -> bool:
        """Whether the family changes the training semantics: WPipe's first group of parts computes each
        step on its weights from one update earlier (planner/schedules/generate.py). The search considers
        it only when the user allows stale weights.

        >>> [kind.value for kind in ScheduleKind if kind.stale_weights]
        ['wpipe']
        """
        return self is ScheduleKind.WPIPE

    @property
    def splits_backward(self) -> bool:
        """Whether the family splits each backward into I and W (its W writes the weights' gradients itself, so
        the data-parallel all-reduce starts after it, not during it)."""
        return self is ScheduleKind.ZB_H1

    def stale_parts(self, num_parts: int) -> range:
        """The parts whose forwards read weights one update old: WPipe's first group (none for the others).

        >>> ScheduleKind.WPIPE.stale_parts(6), ScheduleKind.ONE_F_ONE_B.stale_parts(6)
        (range(0, 3), range(0, 0))
        """
        return range(num_parts // 2) if self.stale_weights else range(0)
