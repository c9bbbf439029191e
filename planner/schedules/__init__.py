"""Schedules as data: generate per-rank programs, lower them, validate, simulate and draw them.

Standard library only, so the runtime can import it cheaply.

>>> from planner.schedules import GENERATORS, lower, validate, simulate, StageCosts, SimCosts
>>> schedule = GENERATORS["1f1b"](4, 8)
>>> programs = lower(schedule.programs, schedule.stage_map, {(0, 1), (1, 2), (2, 3)}, data_parallel=False)
>>> validate(programs, schedule.stage_map)
>>> stage = StageCosts(fwd_ms=1.0, bwd_ms=2.0, activation_bytes=1, static_bytes=0)
>>> simulate(programs, schedule.stage_map, SimCosts((stage,) * 4, {})).step_ms
33.0
"""

from __future__ import annotations

from planner.schedules.actions import (
    Action,
    ActionKind,
    Program,
    Programs,
    StageMap,
    format_programs,
    parse_programs,
)
from planner.schedules.generate import GENERATORS, Schedule, generate, in_flight, max_in_flight
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
    "StageMap",
    "chrome_trace",
    "format_grid",
    "format_programs",
    "generate",
    "in_flight",
    "lower",
    "max_in_flight",
    "parse_programs",
    "simulate",
    "svg",
    "validate",
]
