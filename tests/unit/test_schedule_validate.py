"""planner.schedules.validate: hand-broken programs are rejected with the reason and a marked grid."""

from __future__ import annotations

import pickle

import pytest

from planner.plan import Layout
from planner.schedules.actions import Programs, parse_programs
from planner.schedules.generate import generate
from planner.schedules.lower import lower
from planner.schedules.validate import ScheduleError, format_grid, validate

CHAIN_2 = {(0, 1)}

# Lowered GPipe, 2 stages, 2 micro-batches (what lower() produces; checked first below).
GPIPE_2x2 = [row.split() for row in (
    "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0OPTIMIZER_STEP",
    "1RECV_F0<0 1F0 1RECV_F1<0 1F1 1B0 1SEND_B0>0 1B1 1SEND_B1>0 1OPTIMIZER_STEP",
)]


def _programs(rows: list[list[str]]) -> Programs:
    return parse_programs(rows)


def _rejected(rows: list[list[str]], layout: Layout | None = None, **kwargs: object) -> ScheduleError:
    with pytest.raises(ScheduleError) as error:
        validate(_programs(rows), layout or Layout.pipeline(len(rows)), **kwargs)  # type: ignore[arg-type]
    assert "rank 0" in str(error.value) and "step" in str(error.value)  # the grid is in the message
    return error.value


def _broken(edit) -> list[list[str]]:
    rows = [list(row) for row in GPIPE_2x2]
    edit(rows)
    return rows


def test_the_unbroken_program_is_what_lower_produces_and_valid() -> None:
    schedule = generate("gpipe", 2, 2)
    assert lower(schedule.programs, schedule.layout, CHAIN_2) == _programs(GPIPE_2x2)
    validate(_programs(GPIPE_2x2), schedule.layout, edges=CHAIN_2)


def test_b_before_its_f() -> None:
    rows = _broken(lambda rows: rows[1].insert(1, rows[1].pop(4)))  # 1B0 moved before 1F0
    error = _rejected(rows)
    assert error.reason.startswith("B before its F: 1B0 runs before 1F0")
    assert "[1B0]!" in str(error) and error.marks == ((1, 1),)


def test_removed_receive_leaves_a_send_unmatched() -> None:
    error = _rejected(_broken(lambda rows: rows[1].remove("1RECV_F1<0")))
    assert "send without matching receive: 0SEND_F1>1" in error.reason
    assert "[0SEND_F1>1]!" in str(error)


def test_removed_receive_in_the_middle_is_out_of_order() -> None:
    schedule = generate("gpipe", 2, 3)
    rows = [[str(a) for a in program] for program in lower(schedule.programs, schedule.layout, CHAIN_2)]
    rows[1].remove("1RECV_F1<0")
    error = _rejected(rows)
    assert "out of order: 1RECV_F2<0 expects 0SEND_F2>1 but the next message from rank 0 is 0SEND_F1>1" \
        in error.reason
    assert "[1RECV_F2<0]!" in str(error) and "[0SEND_F1>1]!" in str(error)


def test_removed_send_leaves_a_receive_waiting() -> None:
    error = _rejected(_broken(lambda rows: rows[1].remove("1SEND_B1>0")))
    assert "receive without matching send: 0RECV_B1<1 on rank 0 waits for 1SEND_B1>0" in error.reason
    assert "[0RECV_B1<1]!" in str(error)


def test_send_moved_after_a_receive_deadlocks() -> None:
    def swap(rows: list[list[str]]) -> None:
        rows[0][3], rows[0][4] = rows[0][4], rows[0][3]  # 0RECV_B0<1 now comes before 0SEND_F1>1
    error = _rejected(_broken(swap))
    assert error.reason.startswith("deadlock: every unfinished rank waits on a receive")
    assert "rank 0 at 0RECV_B0<1" in error.reason and "rank 1 at 1RECV_F1<0" in error.reason
    assert "[0RECV_B0<1]!" in str(error) and "[1RECV_F1<0]!" in str(error)


def test_swapped_sends_on_one_channel_are_out_of_order() -> None:
    def swap(rows: list[list[str]]) -> None:
        rows[0][:4] = ["0F0", "0F1", "0SEND_F1>1", "0SEND_F0>1"]
    error = _rejected(_broken(swap))
    assert "out of order: 1RECV_F0<0 expects 0SEND_F0>1" in error.reason


def test_send_before_its_compute() -> None:
    def swap(rows: list[list[str]]) -> None:
        rows[0][:4] = ["0F0", "0SEND_F0>1", "0SEND_F1>1", "0F1"]
    assert "0SEND_F1>1 runs before the F that produces it (0F1)" in _rejected(_broken(swap)).reason


def test_duplicated_f() -> None:
    error = _rejected(_broken(lambda rows: rows[0].insert(2, "0F0")))
    assert error.reason == "duplicated F: stage 0 micro-batch 0 appears 2 times on rank 0"
    assert "[0F0]!" in str(error) and error.marks == ((0, 0), (0, 2))


def test_missing_b() -> None:
    error = _rejected(_broken(lambda rows: rows[0].remove("0B1")))
    assert "missing B: rank 0 runs stage 0 but has no B for micro-batch 1" in error.reason


def test_optimizer_step_before_the_last_backward() -> None:
    error = _rejected(_broken(lambda rows: rows[1].insert(5, rows[1].pop())))
    assert "1OPTIMIZER_STEP runs before all 2 backwards of stage 1 (only 1 done)" in error.reason


def test_action_on_the_wrong_rank() -> None:
    error = _rejected(_broken(lambda rows: rows[0].append("1ALLREDUCE")))
    assert "1ALLREDUCE is in rank 0's program but stage 1 runs on ranks 1" in error.reason


def test_communication_the_edges_need_is_checked() -> None:
    three = generate("gpipe", 3, 1)
    programs = lower(three.programs, three.layout, {(0, 1), (1, 2)})
    with pytest.raises(ScheduleError, match=r"communication missing for the edges given: .*0SEND_F0>2"):
        validate(programs, three.layout, edges={(0, 1), (1, 2), (0, 2)})


def test_long_grids_show_the_columns_around_the_failure() -> None:
    schedule = generate("1f1b", 4, 16)
    rows = [[str(a) for a in program] for program in lower(schedule.programs, schedule.layout,
                                                            {(0, 1), (1, 2), (2, 3)})]
    forward = rows[3].index("3F14")
    rows[3][forward], rows[3][forward + 1] = rows[3][forward + 1], rows[3][forward]
    message = str(_rejected(rows))
    last_step = max(len(row) for row in rows) - 1
    assert "[3B14]!" in message and f"(steps {forward - 8}..{forward + 8} of 0..{last_step} shown)" in message
    header, first_row = message.splitlines()[1:3]
    assert header.split() == ["step"] + [str(step) for step in range(forward - 8, forward + 9)]
    assert first_row.startswith("rank 0")


def test_format_grid_marks_cells() -> None:
    grid = format_grid(_programs([["0F0", "0B0"], ["1F0"]]), [(0, 1)])
    assert grid.splitlines() == ["step    0    1", "rank 0  0F0  [0B0]!", "rank 1  1F0"]


def test_duplicated_optimizer_step() -> None:
    error = _rejected(_broken(lambda rows: rows[0].append("0OPTIMIZER_STEP")))
    assert error.reason == "duplicated OPTIMIZER_STEP: stage 0 runs it 2 times on rank 0"
    assert error.marks == ((0, 8), (0, 9))


def test_schedule_error_survives_pickling() -> None:
    error = _rejected(_broken(lambda rows: rows[0].remove("0B1")))
    assert str(pickle.loads(pickle.dumps(error))) == str(error)
    assert isinstance(error, ValueError)
