"""Timelines of a simulated step: Chrome trace JSON (opens in Perfetto) and an SVG Gantt chart."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

from planner.schedules.actions import Action, ActionKind
from planner.schedules.simulate import COMM_LANE, COMPUTE_LANE, COPY_LANE, SimEvent, SimResult

_LANE_TIDS = {COMPUTE_LANE: 0, COMM_LANE: 1, COPY_LANE: 2}
_COLOURS = {ActionKind.F: "#4c78a8", ActionKind.B: "#f58518", ActionKind.I: "#e45756", ActionKind.W: "#eeca3b",
            ActionKind.OPTIMIZER_STEP: "#54a24b", ActionKind.RECOMPUTE: "#b279a2"}
_GREY = "#9d9d9d"
_ROW_PX, _TOP_PX, _LEFT_PX, _AXIS_PX, _LEGEND_PX, _CHAR_PX = 36, 40, 70, 30, 24, 6.5
_LEGEND = (("forward (F)", _COLOURS[ActionKind.F], "box"), ("backward (B)", _COLOURS[ActionKind.B], "box"),
           ("input gradient (I)", _COLOURS[ActionKind.I], "box"), ("weight gradient (W)", _COLOURS[ActionKind.W], "box"),
           ("optimizer step", _COLOURS[ActionKind.OPTIMIZER_STEP], "box"),
           ("recompute", _COLOURS[ActionKind.RECOMPUTE], "box"), ("all-reduce", _GREY, "box"),
           ("transfer", _GREY, "bar"))


def chrome_trace(result: SimResult, *, rank_names: Sequence[str] | None = None) -> dict[str, Any]:
    """Chrome trace event JSON: one complete ("X") event per action, memory as counter ("C") events.

    pid is the rank, tid the lane (0 compute, 1 comm, named by metadata events); times in µs.

    >>> from planner.schedules.simulate import SimEvent, SimResult
    >>> one = SimResult(2.0, 0.0, (2.0,), (5,), (((0.0, 5),),), (SimEvent(0, "0F0", 0.0, 2.0, "compute"),))
    >>> [event["ph"] for event in chrome_trace(one)["traceEvents"]]
    ['M', 'M', 'M', 'M', 'X', 'C']
    """
    names = _rank_names(result, rank_names)
    events: list[dict[str, Any]] = []
    for rank, name in enumerate(names):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}})
        for lane, tid in _LANE_TIDS.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
    events.extend(_complete_event(event) for event in result.events)
    for rank, timeline in enumerate(result.memory_timeline):
        events.extend({"ph": "C", "name": "memory", "pid": rank, "tid": 0, "ts": _us(time_ms),
                       "args": {"bytes": nbytes}} for time_ms, nbytes in timeline)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_ms": result.step_ms, "bubble_fraction": result.bubble_fraction}}


def _rank_names(result: SimResult, rank_names: Sequence[str] | None) -> list[str]:
    if rank_names is None:
        return [f"rank {rank}" for rank in range(result.num_ranks)]
    if len(rank_names) != result.num_ranks:
        raise ValueError(f"got {len(rank_names)} rank names for {result.num_ranks} ranks")
    return list(rank_names)


def _complete_event(event: SimEvent) -> dict[str, Any]:
    return {"ph": "X", "name": event.action, "cat": event.lane, "pid": event.rank,
            "tid": _LANE_TIDS[event.lane], "ts": _us(event.start_ms), "dur": _us(event.end_ms - event.start_ms),
            "args": {"action": event.action}}


def _us(time_ms: float) -> float:
    return round(time_ms * 1000.0, 3)


def svg(result: SimResult, *, width: int = 1000, rank_names: Sequence[str] | None = None) -> str:
    """A Gantt chart: one row per rank, F and B boxes labelled with the micro-batch, transfers in grey.

    Rows are labelled with ``rank_names`` (default ``rank N``; planner.simulation.rank_names adds
    each rank's stages); a legend under the time axis names the colours. Compute events are
    ``<rect class="compute F">`` (or B, ...); the all-reduce is a grey box in the row and a
    transfer a thin grey bar under it, both ``class="comm"``; time spent waiting in a receive is
    not drawn.

    >>> from planner.schedules.simulate import SimEvent, SimResult
    >>> one = SimResult(2.0, 0.0, (2.0,), (5,), (((0.0, 5),),), (SimEvent(0, "0F0", 0.0, 2.0, "compute"),))
    >>> svg(one).startswith("<svg")
    True
    """
    names = _rank_names(result, rank_names)
    left_px = max(_LEFT_PX, round(_CHAR_PX * max(len(name) for name in names)) + 10)
    plot_px = max(width - left_px - 20, 100)
    scale = plot_px / result.step_ms if result.step_ms > 0 else 0.0
    axis_y = _TOP_PX + _ROW_PX * result.num_ranks
    height = axis_y + _AXIS_PX + _LEGEND_PX
    header = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
              f'font-family="sans-serif" font-size="11">')
    title = (f'<text x="{left_px}" y="20" font-size="14">step {result.step_ms:.3f} ms, '
             f'bubble {result.bubble_fraction:.1%}</text>')
    parts = [header, title]
    parts.extend(f'<text class="row" x="4" y="{_row_y(rank) + _ROW_PX * 0.5:.1f}">{escape(name)}</text>'
                 for rank, name in enumerate(names))
    parts.extend(_box(event, scale, left_px) for event in result.events if _drawn(event))
    parts.extend(_axis(result.step_ms, scale, axis_y, left_px))
    parts.extend(_legend(left_px, axis_y + _AXIS_PX + 12))
    parts.append("</svg>")
    return "\n".join(parts)


def _legend(x_px: float, y_px: float) -> list[str]:
    """One swatch and label per colour, in a row: ``<g class="legend">``."""
    parts = ['<g class="legend">']
    for label, colour, shape in _LEGEND:
        top, size = (y_px - 9, 10) if shape == "box" else (y_px - 3, 4)
        parts.append(f'<rect x="{x_px:.1f}" y="{top:.1f}" width="14" height="{size}" fill="{colour}"/>')
        parts.append(f'<text x="{x_px + 18:.1f}" y="{y_px:.1f}">{escape(label)}</text>')
        x_px += 26 + _CHAR_PX * len(label)
    parts.append("</g>")
    return parts


def _row_y(rank: int) -> float:
    return _TOP_PX + rank * _ROW_PX


def _drawn(event: SimEvent) -> bool:
    kind = Action.parse(event.action).kind
    return event.lane == COMPUTE_LANE or (not kind.is_recv and event.end_ms > event.start_ms)


def _box(event: SimEvent, scale: float, left_px: float) -> str:
    action = Action.parse(event.action)
    x = left_px + event.start_ms * scale
    box_px = (event.end_ms - event.start_ms) * scale
    if event.lane == COMM_LANE and not action.kind.is_per_stage:  # a transfer: thin bar under the row
        y = _row_y(event.rank) + _ROW_PX * 0.72
        return (f'<rect class="comm" x="{x:.2f}" y="{y:.1f}" width="{box_px:.2f}" height="{_ROW_PX * 0.16:.1f}" '
                f'fill="{_GREY}"><title>{escape(event.action)}</title></rect>')
    y = _row_y(event.rank) + _ROW_PX * 0.1
    css_class = "compute " + action.kind.value if event.lane == COMPUTE_LANE else "comm"
    box = (f'<rect class="{css_class}" x="{x:.2f}" y="{y:.1f}" width="{box_px:.2f}" '
           f'height="{_ROW_PX * 0.6:.1f}" fill="{_COLOURS.get(action.kind, _GREY)}" stroke="white" '
           f'stroke-width="0.5"><title>{escape(event.action)}</title></rect>')
    label = "" if action.microbatch is None else str(action.microbatch)
    if label and box_px >= 7 * len(label) + 2:
        box += (f'<text x="{x + box_px / 2:.2f}" y="{y + _ROW_PX * 0.4:.1f}" text-anchor="middle" '
                f'fill="white">{label}</text>')
    return box


def _axis(step_ms: float, scale: float, y: float, left_px: float) -> list[str]:
    parts = [f'<line x1="{left_px}" y1="{y:.1f}" x2="{left_px + step_ms * scale:.2f}" y2="{y:.1f}" '
             f'stroke="black"/>']
    tick = _tick_ms(step_ms)
    count = int(step_ms / tick + 1e-9) + 1 if tick > 0 else 1
    for index in range(count):
        x = left_px + index * tick * scale
        parts.append(f'<line x1="{x:.2f}" y1="{y:.1f}" x2="{x:.2f}" y2="{y + 4:.1f}" stroke="black"/>')
        parts.append(f'<text x="{x:.2f}" y="{y + 16:.1f}" text-anchor="middle">{index * tick:g} ms</text>')
    return parts


def _tick_ms(step_ms: float) -> float:
    """A 1-2-5 step giving about ten ticks."""
    if step_ms <= 0:
        return 0.0
    raw = step_ms / 10
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(magnitude * factor for factor in (1, 2, 5, 10) if magnitude * factor >= raw)
