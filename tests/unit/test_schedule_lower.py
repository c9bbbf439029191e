"""planner.schedules.lower: communication inserted into compute programs, validated over a grid."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.plan import Layout
from planner.schedules.actions import Action, ActionKind, Programs, format_programs, matching_recv
from planner.schedules.generate import generate, gpipe, one_f_one_b
from planner.schedules.lower import lower
from planner.schedules.validate import validate


def _chain(num_stages: int) -> set[tuple[int, int]]:
    return {(stage, stage + 1) for stage in range(num_stages - 1)}


def _skips(num_stages: int) -> set[tuple[int, int]]:
    return _chain(num_stages) | {(stage, stage + 2) for stage in range(num_stages - 2)}


def _dense(num_stages: int) -> set[tuple[int, int]]:
    return {(src, dst) for dst in range(num_stages) for src in range(dst)}


def _program(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(word) for word in text.split())


def _rows(table: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(row.split()) for row in table)


# GPipe, 3 stages, 2 micro-batches, chain plus the skip edge (0, 2).
GPIPE_3x2_SKIP = (
    ("0F0 0SEND_F0>1 0SEND_F0>2 0F1 0SEND_F1>1 0SEND_F1>2 "
     "0RECV_B0<1 0RECV_B0<2 0B0 0RECV_B1<1 0RECV_B1<2 0B1 0OPTIMIZER_STEP"),
    ("1RECV_F0<0 1F0 1SEND_F0>2 1RECV_F1<0 1F1 1SEND_F1>2 "
     "1RECV_B0<2 1B0 1SEND_B0>0 1RECV_B1<2 1B1 1SEND_B1>0 1OPTIMIZER_STEP"),
    ("2RECV_F0<0 2RECV_F0<1 2F0 2RECV_F1<0 2RECV_F1<1 2F1 "
     "2B0 2SEND_B0>0 2SEND_B0>1 2B1 2SEND_B1>0 2SEND_B1>1 2OPTIMIZER_STEP"),
)


def test_skip_edge_lowering_equals_literal_table() -> None:
    schedule = gpipe(3, 2)
    programs = lower(schedule.programs, schedule.layout, _skips(3))
    assert format_programs(programs) == _rows(GPIPE_3x2_SKIP)
    assert "0SEND_F1>2" in _rows(GPIPE_3x2_SKIP)[0] and "0RECV_B1<2" in _rows(GPIPE_3x2_SKIP)[0]
    validate(programs, schedule.layout, edges=_skips(3))


def test_data_parallel_appends_allreduce_then_optimizer_step() -> None:
    schedule = one_f_one_b(2, 2, data_parallel=2)
    programs = lower(schedule.programs, schedule.layout, _chain(2))
    assert format_programs(programs) == _rows((
        "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0ALLREDUCE 0OPTIMIZER_STEP",
        "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1ALLREDUCE 1OPTIMIZER_STEP",
    ))
    validate(schedule.layout.rank_programs(programs), schedule.layout, edges=_chain(2))


def _assert_sends_match_receives(programs: Programs) -> None:
    actions = Counter(action for program in programs for action in program)
    sends = {action: count for action, count in actions.items() if action.kind.is_send}
    receives = {action: count for action, count in actions.items() if action.kind.is_recv}
    assert all(count == 1 for count in (*sends.values(), *receives.values()))
    assert {matching_recv(send) for send in sends} == set(receives)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("edges_of", [_chain, _skips, _dense], ids=["chain", "skips", "dense"])
@pytest.mark.parametrize("num_stages", range(1, 7))
@pytest.mark.parametrize("num_microbatches", range(1, 9))
def test_lowered_schedules_validate(kind: str, edges_of, num_stages: int, num_microbatches: int) -> None:
    schedule = generate(kind, num_stages, num_microbatches, data_parallel=1 + num_stages % 2)
    edges = edges_of(num_stages)
    programs = lower(schedule.programs, schedule.layout, edges)
    _assert_sends_match_receives(programs)
    validate(schedule.layout.rank_programs(programs), schedule.layout, edges=edges)


def test_stages_on_one_slot_exchange_nothing() -> None:
    layout = Layout.replicated((0, 1, 1, 0))  # a mirrored placement: stages 0 and 3 share slot 0
    compute = (
        _program("0F0 3F0 3B0 0B0"),
        _program("1F0 2F0 2B0 1B0"),
    )
    programs = lower(compute, layout, _skips(4) | {(0, 3)})
    communication = [(slot, action) for slot, program in enumerate(programs) for action in program
                     if action.kind.is_communication]
    assert communication and all(layout.slot(action.peer or 0) != slot for slot, action in communication)
    texts = [str(action) for action in programs[0]]
    assert texts.index("0OPTIMIZER_STEP") < texts.index("3OPTIMIZER_STEP")  # part order, though 3 finishes first
    validate(programs, layout, edges=_skips(4) | {(0, 3)})


def test_sends_are_held_back_to_the_receivers_order() -> None:
    # Slot 0 runs stages 0 and 2, slot 1 stages 1 and 3; slot 1 takes 0->1 of micro-batch 1
    # before 0->3 of micro-batch 0, so slot 0 must send in that order although it computes 0F1 later.
    layout = Layout.replicated((0, 1, 0, 1))
    compute = (
        _program("0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1"),
        _program("1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"),
    )
    edges = {(0, 1), (1, 2), (2, 3), (0, 3)}
    programs = lower(compute, layout, edges)
    sends_to_slot_1 = [str(a) for a in programs[0] if a.kind.is_send and layout.slot(a.peer or 0) == 1]
    assert sends_to_slot_1[:4] == ["0SEND_F0>1", "0SEND_F1>1", "0SEND_F0>3", "2SEND_F0>3"]
    validate(programs, layout, edges=edges)


def _random_compute_programs(layout: Layout, edges: set[tuple[int, int]], num_microbatches: int,
                             rng: random.Random) -> Programs:
    """Project a random dependency-respecting global order of all F and B onto the ranks."""
    def needs(kind: ActionKind, stage: int, microbatch: int) -> list[tuple[ActionKind, int, int]]:
        if kind is ActionKind.F:
            return [(ActionKind.F, src, microbatch) for src, dst in edges if dst == stage]
        return [(ActionKind.F, stage, microbatch)] + [(ActionKind.B, dst, microbatch) for src, dst in edges
                                                      if src == stage]

    pending = {(kind, stage, m) for kind in (ActionKind.F, ActionKind.B)
               for stage in range(layout.num_stages) for m in range(num_microbatches)}
    done: set[tuple[ActionKind, int, int]] = set()
    programs: list[list[Action]] = [[] for _ in range(layout.num_slots)]
    while pending:
        ready = sorted(item for item in pending if all(need in done for need in needs(*item)))
        kind, stage, microbatch = rng.choice(ready)
        pending.remove((kind, stage, microbatch))
        done.add((kind, stage, microbatch))
        programs[layout.slot(stage)].append(Action(stage, kind, microbatch))
    return tuple(tuple(program) for program in programs)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_placement_tiles_replicas_and_dag_lower_to_a_valid_program(data: st.DataObject) -> None:
    """Stages placed on slots at random (several per slot), slots split into 1-3 spatial tiles, 1-2
    replicas: every rank's program validates, with messages between every tile pair."""
    num_stages = data.draw(st.integers(1, 6), label="num_stages")
    num_slots = data.draw(st.integers(1, num_stages), label="num_slots")
    slots = list(range(num_slots)) + data.draw(
        st.lists(st.integers(0, num_slots - 1), min_size=num_stages - num_slots, max_size=num_stages - num_slots))
    tiles = data.draw(st.lists(st.integers(1, 3), min_size=num_slots, max_size=num_slots), label="tiles")
    layout = Layout.replicated(tuple(data.draw(st.permutations(slots), label="placement")),
                               data.draw(st.integers(1, 2), label="replicas"), tiles=tiles)
    pairs = sorted(_dense(num_stages))
    edges = set(data.draw(st.lists(st.sampled_from(pairs), unique=True), label="edges")) if pairs else set()
    num_microbatches = data.draw(st.integers(1, 4), label="num_microbatches")
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    compute = _random_compute_programs(layout, edges, num_microbatches, rng)
    programs = lower(compute, layout, edges)
    _assert_sends_match_receives(programs)
    validate(layout.rank_programs(programs), layout, edges=edges)


@pytest.mark.parametrize(("edges", "needle"), [({(1, 0)}, r"edge \(1, 0\)"), ({(0, 4)}, r"edge \(0, 4\)")])
def test_bad_edges_are_rejected(edges: set[tuple[int, int]], needle: str) -> None:
    schedule = gpipe(3, 2)
    with pytest.raises(ValueError, match=needle):
        lower(schedule.programs, schedule.layout, edges)


def test_lower_takes_compute_programs_only() -> None:
    schedule = gpipe(2, 1)
    lowered = lower(schedule.programs, schedule.layout, _chain(2))
    with pytest.raises(ValueError, match="compute-only.*0SEND_F0>1"):
        lower(lowered, schedule.layout, _chain(2))
    with pytest.raises(ValueError, match="1 programs but the layout has 2 slots"):
        lower(schedule.programs[:1], schedule.layout, _chain(2))
