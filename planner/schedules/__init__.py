"""Schedules as data: generate per-slot programs and a layout, lower them, validate, simulate, draw.

Standard library only, so the runtime can import it cheaply.

>>> from planner.schedules import generate, lower, validate, simulate, StageCosts, SimCosts
>>> schedule = generate("1f1b", 4, 8)
>>> programs = schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, {(0, 1), (1, 2), (2, 3)}))
>>> validate(programs, schedule.layout)
>>> stage = StageCosts(fwd_ms=1.0, bwd_ms=2.0, activation_bytes=1, static_bytes=0)
>>> simulate(programs, schedule.layout, SimCosts((stage,) * 4, {})).step_ms
33.0
"""

from __future__ import annotations

from planner.schedules.actions import (
    Action,
    ActionKind,
    Program,
    Programs,
    format_programs,
    parse_programs,
)
from planner.schedules.generate import GENERATORS, Schedule, generate, in_flight_profiles, max_in_flight
from planner.schedules.lower import lower
from planner.schedules.simulate import SimCosts, SimEvent, SimResult, StageCosts, simulate
from planner.schedules.timeline import chrome_trace, svg
from planner.schedules.validate import ScheduleError, format_grid, validate

__all__ = [
    "GENERATORS",
    "Action",
    "ActionKind",
    "Program",
    "Programs",
    "Schedule",
    "ScheduleError",
    "SimCosts",
    "SimEvent",
    "SimResult",
    "StageCosts",
    "chrome_trace",
    "format_grid",
    "format_programs",
    "generate",
    "in_flight_profiles",
    "lower",
    "max_in_flight",
    "parse_programs",
    "simulate",
    "svg",
    "validate",
]
