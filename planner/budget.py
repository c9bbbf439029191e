"""The per-GPU memory budget: what the user gives, the reserve kept free, and what plans may use."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.errors import InvalidArgument
from cost_models.units import format_bytes, parse_mem_bytes

DEFAULT_RESERVE = "5%"
"""Kept free on every GPU by default: the CUDA context (300-500 MiB) and allocator fragmentation."""


@dataclass(frozen=True)
class Reserve:
    """Memory a plan leaves free on every GPU: a fixed size plus a share of the budget."""

    nbytes: int = 0
    fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.nbytes < 0 or not 0.0 <= self.fraction < 1.0:
            given = f"{self.fraction:.0%}" if self.fraction else f"{self.nbytes} bytes"
            given += f" and {self.nbytes} bytes" if self.fraction and self.nbytes else ""
            raise InvalidArgument(f"a reserve is a size >= 0 or a percentage in [0%, 100%), got {given}; "
                                  f"give e.g. --reserve 5% or --reserve 1GB (plan(reserve=...))")

    def bytes_of(self, mem_bytes: int) -> int:
        """The bytes kept free out of a budget of ``mem_bytes``."""
        return self.nbytes + math.ceil(self.fraction * mem_bytes)

    def mem_for(self, usable_bytes: int) -> int:
        """The smallest budget that leaves ``usable_bytes`` after this reserve."""
        mem_bytes = math.ceil((usable_bytes + self.nbytes) / (1.0 - self.fraction))
        while mem_bytes - self.bytes_of(mem_bytes) < usable_bytes:
            mem_bytes += 1
        return mem_bytes

    def describe(self) -> str:
        parts = [format_bytes(self.nbytes)] if self.nbytes else []
        parts += [f"{self.fraction:.0%}"] if self.fraction else []
        return " + ".join(parts) or "none"


def parse_reserve(value: str | int | Reserve, *, unit_required: bool = False) -> Reserve:
    """``"5%"`` → a share of the budget; ``"1GB"`` (or an int of bytes) → a fixed size."""
    if isinstance(value, Reserve):
        return value
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            raise InvalidArgument(f"cannot parse reserve {value!r}; write e.g. '5%' or '1GB'") from None
        return Reserve(fraction=percent / 100.0)
    if value == 0 or (isinstance(value, str) and value.strip() == "0"):
        return Reserve()
    return Reserve(nbytes=parse_mem_bytes(value, unit_required=unit_required))


def usable_bytes(mem_bytes: int, reserve: Reserve) -> int:
    """What a plan may use of ``mem_bytes`` once ``reserve`` is kept free; refuses a reserve taking it all."""
    usable = mem_bytes - reserve.bytes_of(mem_bytes)
    if usable <= 0:
        raise InvalidArgument(f"the reserve ({reserve.describe()}) leaves nothing of the "
                              f"{format_bytes(mem_bytes)} budget; give a smaller --reserve or more --mem")
    return usable
