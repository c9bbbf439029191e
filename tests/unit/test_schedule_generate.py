"""planner.schedules.generate: GPipe and 1F1B programs against literal tables; in-flight counts."""

from __future__ import annotations

import pytest

from planner.plan import Layout, ScheduleKind
from planner.schedules.actions import format_programs
from planner.schedules.generate import GENERATORS, generate, gpipe, max_in_flight, one_f_one_b

GPIPE_4x6 = (
    "0F0 0F1 0F2 0F3 0F4 0F5 0B0 0B1 0B2 0B3 0B4 0B5",
    "1F0 1F1 1F2 1F3 1F4 1F5 1B0 1B1 1B2 1B3 1B4 1B5",
    "2F0 2F1 2F2 2F3 2F4 2F5 2B0 2B1 2B2 2B3 2B4 2B5",
    "3F0 3F1 3F2 3F3 3F4 3F5 3B0 3B1 3B2 3B3 3B4 3B5",
)

ONE_F_ONE_B_4x6 = (
    "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5",
    "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5",
    "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5",
    "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5",
)

# Fewer micro-batches than stages: warm-up is cut to M, there is no steady state.
ONE_F_ONE_B_4x2 = (
    "0F0 0F1 0B0 0B1",
    "1F0 1F1 1B0 1B1",
    "2F0 2F1 2B0 2B1",
    "3F0 3B0 3F1 3B1",
)


def _rows(table: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(row.split()) for row in table)


@pytest.mark.parametrize(("schedule", "table"), [
    (gpipe(4, 6), GPIPE_4x6),
    (one_f_one_b(4, 6), ONE_F_ONE_B_4x6),
    (one_f_one_b(4, 2), ONE_F_ONE_B_4x2),
])
def test_programs_equal_literal_tables(schedule, table: tuple[str, ...]) -> None:
    assert format_programs(schedule.programs) == _rows(table)
    assert schedule.layout == Layout.pipeline(4)


def test_registry_holds_every_kind_and_generate_looks_them_up() -> None:
    assert set(GENERATORS) == set(ScheduleKind)  # no kind is advertised without a generator
    assert generate("1f1b", 4, 6) == one_f_one_b(4, 6)
    assert generate("gpipe", 4, 6).kind is ScheduleKind.GPIPE
    assert generate("gpipe", 2, 3, data_parallel=4).layout == Layout.pipeline(2, 4)
    with pytest.raises(ValueError, match="unknown schedule kind 'zigzag'.*gpipe, 1f1b"):
        generate("zigzag", 4, 6)
    with pytest.raises(TypeError):
        GENERATORS["new"] = gpipe  # type: ignore[index]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(0, 4), (4, 0)])
def test_sizes_must_be_positive(kind: str, num_stages: int, num_microbatches: int) -> None:
    with pytest.raises(ValueError, match=f"num_stages={num_stages}, num_microbatches={num_microbatches}"):
        generate(kind, num_stages, num_microbatches)


@pytest.mark.parametrize("num_stages", range(1, 9))
@pytest.mark.parametrize("num_microbatches", range(1, 13))
def test_in_flight_matches_the_formula(num_stages: int, num_microbatches: int) -> None:
    stages = range(num_stages)
    assert max_in_flight(gpipe(num_stages, num_microbatches)) == tuple(num_microbatches for _ in stages)
    assert max_in_flight(one_f_one_b(num_stages, num_microbatches)) == tuple(
        min(num_microbatches, num_stages - stage) for stage in stages)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_each_stage_runs_every_f_then_b_once(kind: str) -> None:
    schedule = generate(kind, 5, 7)
    for stage, program in enumerate(schedule.programs):
        texts = [str(action) for action in program]
        assert sorted(texts) == sorted([f"{stage}F{m}" for m in range(7)] + [f"{stage}B{m}" for m in range(7)])
        assert all(texts.index(f"{stage}F{m}") < texts.index(f"{stage}B{m}") for m in range(7))


def test_max_in_flight_counts_from_the_program() -> None:
    assert max_in_flight(one_f_one_b(3, 8)) == (3, 2, 1)
