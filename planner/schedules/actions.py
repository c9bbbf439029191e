"""Schedule actions as data: the action kinds and one immutable action that prints and parses."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


class ActionKind(str, Enum):
    """What one step of a rank's program does; the value is the text used in ``str(action)``."""

    F = "F"
    B = "B"
    I = "I"  # the input-gradient half of B (the zero-bubble papers' name)
    W = "W"  # the weight-gradient half of B (after I)
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"
    OPTIMIZER_STEP = "OPTIMIZER_STEP"
    SWAP_OUT = "SWAP_OUT"
    SWAP_IN = "SWAP_IN"
    RECOMPUTE = "RECOMPUTE"

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def is_recv(self) -> bool:
        return self in _RECEIVES

    @property
    def is_communication(self) -> bool:
        """A point-to-point send or receive (these carry a peer stage)."""
        return self in _COMMUNICATION

    @property
    def is_per_stage(self) -> bool:
        """A once-per-step action of a whole stage (no micro-batch): ALLREDUCE, OPTIMIZER_STEP."""
        return self in _PER_STAGE

    @property
    def computes_input_grads(self) -> bool:
        """A backward that takes the output gradients and makes the input gradients (B, or its half I):
        ``RECV_B`` goes before it, ``SEND_B`` after it."""
        return self in _INPUT_GRADS

    @property
    def ends_backward(self) -> bool:
        """The action that finishes a micro-batch's backward on a stage (B, or its half W): the saved
        activations are free after it, and the stage's gradients are complete after the last one."""
        return self in _BACKWARD_ENDS

    @property
    def is_backward_direction(self) -> bool:
        """Communication that carries gradients (backward) rather than activations (forward)."""
        return self in _GRADIENT_MESSAGES


# Sets rather than tuples of ``ActionKind.X``: the properties above run once per action in every
# generator, lowering and replay, and a class attribute of an enum is slow to look up.
_SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
_RECEIVES = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
_COMMUNICATION = _SENDS | _RECEIVES
_PER_STAGE = frozenset({ActionKind.ALLREDUCE, ActionKind.OPTIMIZER_STEP})
_INPUT_GRADS = frozenset({ActionKind.B, ActionKind.I})
_BACKWARD_ENDS = frozenset({ActionKind.B, ActionKind.W})
_GRADIENT_MESSAGES = frozenset({ActionKind.SEND_B, ActionKind.RECV_B})

_TEXT = {kind: kind.value for kind in ActionKind}  # an enum's .value is slow to read; str() runs per event

_EXPECTED_FORMS = ("'2F5', '2B5', '2I5', '2W5' (stage, kind, micro-batch); '2SEND_F5>3', '3RECV_F5<2', '3SEND_B5>2', "
                   "'2RECV_B5<3' (sends point > to the peer stage, receives < from it); '2ALLREDUCE', "
                   "'2OPTIMIZER_STEP'; '2SWAP_OUT5', '2SWAP_IN5', '2RECOMPUTE5'")
_ACTION_PATTERN = re.compile(r"^(0|[1-9]\d*)([A-Z_]+)(0|[1-9]\d*)?(?:([<>])(0|[1-9]\d*))?$")


@dataclass(frozen=True)
class Action:
    """One step of a rank's program; prints and parses as a compact string.

    >>> str(Action(2, ActionKind.SEND_F, 5, peer=3))
    '2SEND_F5>3'
    >>> Action.parse("3RECV_F5<2")
    Action(stage=3, kind=<ActionKind.RECV_F: 'RECV_F'>, microbatch=5, peer=2)
    """

    stage: int
    kind: ActionKind
    microbatch: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind(self.kind))
        kind = self.kind
        if self.stage < 0:
            raise ValueError(f"action stage must be >= 0, got {self.stage} in {self!r}")
        if (kind in _PER_STAGE) != (self.microbatch is None):
            need = "no micro-batch" if kind in _PER_STAGE else "a micro-batch"
            raise ValueError(f"{kind.value} takes {need}; got microbatch={self.microbatch}")
        if self.microbatch is not None and self.microbatch < 0:
            raise ValueError(f"micro-batch must be >= 0, got {self.microbatch} in {self!r}")
        if (kind in _COMMUNICATION) != (self.peer is not None):
            need = "a peer stage" if kind.is_communication else "no peer stage"
            raise ValueError(f"{kind.value} takes {need}; got peer={self.peer}")
        if self.peer is not None and (self.peer < 0 or self.peer == self.stage):
            raise ValueError(f"peer stage must be >= 0 and differ from stage {self.stage}, got {self.peer}")

    def __str__(self) -> str:
        text = f"{self.stage}{_TEXT[self.kind]}"
        if self.microbatch is not None:
            text += str(self.microbatch)
        if self.peer is not None:
            text += (">" if self.kind in _SENDS else "<") + str(self.peer)
        return text

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse(str(a)) == a`` and ``str(Action.parse(s)) == s``."""
        match = _ACTION_PATTERN.match(text)
        if match is None or match.group(2) not in ActionKind.__members__:
            raise ValueError(f"cannot parse action {text!r}; expected one of {_EXPECTED_FORMS}")
        stage, kind_name, microbatch, arrow, peer = match.groups()
        kind = ActionKind[kind_name]
        if kind.is_communication and arrow != (">" if kind.is_send else "<"):
            raise ValueError(f"cannot parse action {text!r}: {kind.value} needs "
                             f"{'>' if kind.is_send else '<'}peer; expected one of {_EXPECTED_FORMS}")
        try:
            return cls(int(stage), kind, None if microbatch is None else int(microbatch),
                       None if peer is None else int(peer))
        except ValueError as error:
            raise ValueError(f"cannot parse action {text!r}: {error}; expected one of "
                             f"{_EXPECTED_FORMS}") from None


Program = tuple[Action, ...]
Programs = tuple[Program, ...]


def matching_send(recv: Action) -> Action:
    """The send that a receive takes: ``3RECV_F5<2`` ↔ ``2SEND_F5>3``."""
    if not recv.kind.is_recv:
        raise ValueError(f"{recv} is not a receive")
    kind = ActionKind.SEND_F if recv.kind is ActionKind.RECV_F else ActionKind.SEND_B
    assert recv.peer is not None
    return Action(recv.peer, kind, recv.microbatch, peer=recv.stage)


def matching_recv(send: Action) -> Action:
    """The receive that takes a send: ``2SEND_F5>3`` ↔ ``3RECV_F5<2``."""
    if not send.kind.is_send:
        raise ValueError(f"{send} is not a send")
    kind = ActionKind.RECV_F if send.kind is ActionKind.SEND_F else ActionKind.RECV_B
    assert send.peer is not None
    return Action(send.peer, kind, send.microbatch, peer=send.stage)


def format_programs(programs: Programs) -> tuple[tuple[str, ...], ...]:
    """Programs as rows of action strings (how a plan file stores them)."""
    return tuple(tuple(str(action) for action in program) for program in programs)


def parse_programs(rows: Iterable[Iterable[str]]) -> Programs:
    """Inverse of :func:`format_programs`.

    >>> parse_programs([["0F0", "0B0"]])[0][1].kind
    <ActionKind.B: 'B'>
    """
    return tuple(tuple(Action.parse(text) for text in row) for row in rows)
