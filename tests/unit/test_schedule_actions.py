"""planner.schedules.actions: compact action strings, their parser, and the stage-to-rank map."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.schedules.actions import (
    Action,
    ActionKind,
    format_programs,
    matching_recv,
    matching_send,
    parse_programs,
)

K = ActionKind


@pytest.mark.parametrize(("action", "text"), [
    (Action(2, K.F, 5), "2F5"),
    (Action(2, K.B, 5), "2B5"),
    (Action(2, K.I, 5), "2I5"),
    (Action(12, K.W, 0), "12W0"),
    (Action(2, K.SEND_F, 5, peer=3), "2SEND_F5>3"),
    (Action(3, K.RECV_F, 5, peer=2), "3RECV_F5<2"),
    (Action(3, K.SEND_B, 5, peer=2), "3SEND_B5>2"),
    (Action(2, K.RECV_B, 5, peer=3), "2RECV_B5<3"),
    (Action(2, K.ALLREDUCE), "2ALLREDUCE"),
    (Action(2, K.OPTIMIZER_STEP), "2OPTIMIZER_STEP"),
    (Action(0, K.SWAP_OUT, 1), "0SWAP_OUT1"),
    (Action(0, K.SWAP_IN, 1), "0SWAP_IN1"),
    (Action(10, K.RECOMPUTE, 12), "10RECOMPUTE12"),
])
def test_every_kind_prints_and_parses(action: Action, text: str) -> None:
    assert str(action) == text
    assert Action.parse(text) == action


def test_every_kind_has_a_case_above() -> None:
    assert {kind.value for kind in ActionKind} == {
        "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "ALLREDUCE", "OPTIMIZER_STEP",
        "SWAP_OUT", "SWAP_IN", "RECOMPUTE"}


def _actions() -> st.SearchStrategy[Action]:
    stages = st.integers(0, 200)

    def build(kind: ActionKind, stage: int, microbatch: int, offset: int) -> Action:
        return Action(stage, kind, None if kind.is_per_stage else microbatch,
                      stage + offset if kind.is_communication else None)

    return st.builds(build, st.sampled_from(list(ActionKind)), stages, st.integers(0, 500), st.integers(1, 50))


@given(_actions())
def test_round_trip_property(action: Action) -> None:
    text = str(action)
    assert Action.parse(text) == action
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("text", [
    "", "F5", "2X5", "2F", "2F5>3", "2SEND_F5", "2SEND_F5<3", "3RECV_F5>2", "2ALLREDUCE3",
    "02F5", "2F05", "2f5", " 2F5", "2SEND_F5>2", "-1F5", "2OPTIMIZER_STEP>1",
])
def test_bad_strings_name_the_text_and_the_forms(text: str) -> None:
    with pytest.raises(ValueError) as error:
        Action.parse(text)
    assert repr(text) in str(error.value)
    assert "2SEND_F5>3" in str(error.value) and "2ALLREDUCE" in str(error.value)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"stage": 0, "kind": K.F}, "micro-batch"),
    ({"stage": 0, "kind": K.ALLREDUCE, "microbatch": 1}, "no micro-batch"),
    ({"stage": 0, "kind": K.SEND_F, "microbatch": 1}, "peer"),
    ({"stage": 0, "kind": K.F, "microbatch": 1, "peer": 1}, "no peer"),
    ({"stage": -1, "kind": K.F, "microbatch": 1}, "stage"),
    ({"stage": 1, "kind": K.RECV_B, "microbatch": 1, "peer": 1}, "differ"),
])
def test_inconsistent_actions_are_rejected(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Action(**kwargs)


def test_kind_given_as_text_is_converted() -> None:
    assert Action(1, "F", 0) == Action(1, K.F, 0)  # type: ignore[arg-type]


def test_matching_send_and_receive_are_inverse() -> None:
    send = Action.parse("2SEND_F5>3")
    assert matching_recv(send) == Action.parse("3RECV_F5<2")
    assert matching_send(matching_recv(send)) == send
    assert matching_recv(Action.parse("3SEND_B5>2")) == Action.parse("2RECV_B5<3")
    with pytest.raises(ValueError, match="not a receive"):
        matching_send(send)


def test_programs_round_trip_as_rows_of_strings() -> None:
    rows = (("0F0", "0SEND_F0>1", "0OPTIMIZER_STEP"), ("1RECV_F0<0", "1F0"))
    assert format_programs(parse_programs(rows)) == rows
