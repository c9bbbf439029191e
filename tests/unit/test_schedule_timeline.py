"""planner.schedules.timeline: Chrome trace JSON and SVG Gantt chart of a simulated step."""

from __future__ import annotations

import json
import re
from xml.etree import ElementTree

import pytest

from planner.schedules.generate import generate
from planner.schedules.lower import lower
from planner.schedules.simulate import SimCosts, SimResult, StageCosts, simulate
from planner.schedules.timeline import chrome_trace, svg


@pytest.fixture(name="result")
def _result() -> SimResult:
    schedule = generate("1f1b", 3, 5, data_parallel=2)
    edges = {(0, 1): 0.2, (1, 2): 0.2, (0, 2): 0.3}
    programs = schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, edges))
    stages = tuple(StageCosts(1.0 + stage, 2.0 + stage, 1000, 5000, allreduce_ms=0.5, optimizer_ms=0.25)
                   for stage in range(3))
    return simulate(programs, schedule.layout, SimCosts(stages, edges))


def test_chrome_trace_has_one_complete_event_per_action(result: SimResult) -> None:
    trace = json.loads(json.dumps(chrome_trace(result)))
    complete = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    assert len(complete) == len(result.events)
    assert sorted(event["name"] for event in complete) == sorted(event.action for event in result.events)
    for event in complete:
        assert isinstance(event["pid"], int) and 0 <= event["pid"] < 6  # 3 stages x 2 replicas
        assert event["tid"] in (0, 1) and event["cat"] in ("compute", "comm")
        assert event["ts"] >= 0 and event["dur"] >= 0 and event["args"]["action"] == event["name"]
        assert event["ts"] + event["dur"] <= result.step_ms * 1000 + 1e-6
    forward = next(event for event in complete if event["name"] == "2F0")
    assert forward["dur"] == pytest.approx(3000.0) and forward["tid"] == 0


def test_chrome_trace_counters_and_names(result: SimResult) -> None:
    trace = chrome_trace(result, rank_names=[f"gpu{rank}" for rank in range(6)])
    counters = [event for event in trace["traceEvents"] if event["ph"] == "C"]
    assert len(counters) == sum(len(timeline) for timeline in result.memory_timeline)
    assert max(event["args"]["bytes"] for event in counters if event["pid"] == 0) == result.peak_mem_bytes[0]
    names = {event["args"]["name"] for event in trace["traceEvents"] if event["name"] == "process_name"}
    assert names == {f"gpu{rank}" for rank in range(6)}
    lanes = {event["args"]["name"] for event in trace["traceEvents"] if event["name"] == "thread_name"}
    assert lanes == {"compute", "comm", "copy"}
    with pytest.raises(ValueError, match="2 rank names for 6 ranks"):
        chrome_trace(result, rank_names=["a", "b"])


def test_svg_draws_one_box_per_compute_event(result: SimResult) -> None:
    picture = svg(result, width=800)
    assert picture.startswith("<svg")
    root = ElementTree.fromstring(picture)  # well-formed XML
    assert root.get("width") == "800"
    boxes = re.findall(r'<rect class="compute (\w+)"', picture)
    assert len(boxes) == sum(event.lane == "compute" for event in result.events)
    assert boxes.count("F") == boxes.count("B") == 2 * 15  # two replicas
    assert f"step {result.step_ms:.3f} ms" in picture and f"bubble {result.bubble_fraction:.1%}" in picture
    assert picture.count('class="comm"') == sum(
        "SEND" in event.action or "ALLREDUCE" in event.action for event in result.events)
    assert ">0 ms</text>" in picture and ">4</text>" in picture  # axis, and micro-batch labels


def test_svg_has_a_legend_and_rows_named_by_rank_and_stage(result: SimResult) -> None:
    from planner.schedules.generate import generate
    from planner.simulation import rank_names

    names = rank_names(generate("1f1b", 3, 5, data_parallel=2).layout)
    assert names[:3] == ["rank 0: stage 0, replica 0", "rank 1: stage 0, replica 1",
                         "rank 2: stage 1, replica 0"]
    picture = svg(result, rank_names=names)
    ElementTree.fromstring(picture)
    assert re.findall(r'<text class="row" [^>]*>([^<]*)</text>', picture) == names
    legend = picture[picture.index('<g class="legend">'):]
    for label in ("forward (F)", "backward (B)", "optimizer step", "all-reduce", "transfer"):
        assert f">{label}</text>" in legend
    with pytest.raises(ValueError, match="2 rank names for 6 ranks"):
        svg(result, rank_names=["a", "b"])
