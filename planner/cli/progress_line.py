"""Progress on stderr: one line rewritten in place on a terminal, one line per event otherwise."""

from __future__ import annotations

from typing import TextIO

from planner.progress import ProgressEvent


class ProgressLine:
    """A progress callback for plan(); ``close()`` ends a line left open on a terminal."""

    def __init__(self, stream: TextIO, in_place: bool) -> None:
        self.stream = stream
        self.in_place = in_place
        self._open = False

    def __call__(self, event: ProgressEvent) -> None:
        text = f"tessera: {event.describe()}"
        if self.in_place:
            self.stream.write(f"\r{text}\x1b[K")
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._open = False
