"""CUDA streams and events, with a no-op stand-in on CPU so one code path runs on both.

Example::

    side = new_stream(x.device)            # a CUDA side stream, or NullStream on CPU
    side.wait_stream(current_stream(x.device))
    with use_stream(side):
        packed = x[..., :1].contiguous()   # runs on the side stream
    done = side.record_event()
    current_stream(x.device).wait_event(done)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class Event(Protocol):
    """What a stream records: a point later work can wait for (torch.cuda.Event or NullEvent)."""

    def synchronize(self) -> None: ...


class Stream(Protocol):
    """The part of torch.cuda.Stream the runtime uses; NullStream is the CPU stand-in."""

    def wait_stream(self, stream: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def record_event(self) -> Event: ...


class NullEvent:
    """A CPU event: work on the CPU is already ordered, so there is nothing to wait for."""

    def synchronize(self) -> None:
        return None


class NullStream:
    """The CPU stand-in for a CUDA stream: every ordering call is a no-op."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self) -> Event:
        return NullEvent()


AnyStream = Stream
"""A CUDA stream or a NullStream (kept as a name for callers)."""


def current_stream(device: torch.device) -> Stream:
    """The stream work on ``device`` is issued to now (NullStream off CUDA)."""
    if device.type != "cuda":
        return NullStream()
    return torch.cuda.current_stream(device)


def new_stream(device: torch.device) -> Stream:
    """A fresh side stream on ``device`` (NullStream off CUDA)."""
    if device.type != "cuda":
        return NullStream()
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def use_stream(stream: Stream) -> Iterator[None]:
    """Issue the enclosed work to ``stream``; a no-op for NullStream."""
    if isinstance(stream, NullStream):
        yield
        return
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        yield


def keep_alive(tensor: torch.Tensor, stream: Stream) -> None:
    """Tell the CUDA caching allocator ``tensor`` is used on ``stream`` (no-op on CPU)."""
    if not isinstance(stream, NullStream):
        tensor.record_stream(stream)  # type: ignore[arg-type]
