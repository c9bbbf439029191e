"""Optimizer state paged to files (ZeRO-Infinity's NVMe tier): asynchronous reads and atomic writes.

One file per (rank, stage) in ``--nvme-dir``: the stage's master weights and per-element optimizer
state tensors (Adam's moments, the momentum buffer) back to back, each at a 64-byte aligned
offset. Between steps they live only in that file; :class:`PagedFile` reads them back into an
anonymous memory map (released to the OS as soon as the last view of it is dropped, whatever the
allocator's thresholds) and writes them out after the step, both on one worker thread so a read
queued behind a write reads what was written. Writes go to a temporary file in the same directory
then ``os.replace``: a rank killed mid-write leaves the previous state file (and every checkpoint)
intact. Scalars (Adam's step count) stay in memory: they are not worth a page.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN_BYTES = 64


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in the file."""

    offset_bytes: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def layout(tensors: Sequence[torch.Tensor]) -> tuple[tuple[Slot, ...], int]:
    """Aligned slots for ``tensors`` in order, and the file's size in bytes."""
    slots, offset = [], 0
    for tensor in tensors:
        slots.append(Slot(offset, tensor.numel(), tensor.dtype))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    return tuple(slots), offset


class PagedFile:
    """One stage's paged tensors: ``write`` them out (async), ``read`` them back (async), ``wait``."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.slots: tuple[Slot, ...] = ()
        self.size_bytes = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nvme-{path.name}")
        self._pending: Future[None] | None = None  # the last write
        self._reading: Future[mmap.mmap] | None = None

    def write(self, tensors: Sequence[torch.Tensor]) -> None:
        """Start writing ``tensors`` (CPU, contiguous); they must not change until the write ends,
        which holds them (the caller drops its own references to free the memory)."""
        self.slots, self.size_bytes = layout(tensors)
        self._reading = None
        self._pending = self._worker.submit(_write_file, self.path, self.slots, self.size_bytes, list(tensors))

    def prefetch(self) -> None:
        """Start reading the file back (after any write still in flight); idempotent until ``read``."""
        if self._reading is None and self.slots:
            self._reading = self._worker.submit(_read_file, self.path, self.size_bytes)

    def read(self) -> list[torch.Tensor]:
        """The tensors last written, as views of one fresh memory map (waits for the prefetch)."""
        self.prefetch()
        if self._reading is None:
            return []
        self.wait()  # a failed write must not go unnoticed (the read behind it finds the older file)
        buffer = self._reading.result(timeout=self.timeout_s)
        self._reading = None
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=self.size_bytes) if self.size_bytes else None
        return [raw[slot.offset_bytes:slot.offset_bytes + slot.nbytes].view(slot.dtype)  # type: ignore[index]
                for slot in self.slots]

    def wait(self) -> None:
        """Wait for the last write (raising its error, once)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result(timeout=self.timeout_s)

    def close(self) -> None:
        self.wait()
        self._worker.shutdown(wait=True)


def _write_file(path: Path, slots: Sequence[Slot], size_bytes: int, tensors: list[torch.Tensor]) -> None:
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            for slot, tensor in zip(slots, tensors):
                out.seek(slot.offset_bytes)
                out.write(memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()))
            out.truncate(size_bytes)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        # drop the tensors before the future completes: the pool's work item keeps its arguments
        # until the worker moves on, so a caller that waited would otherwise still see them resident
        tensors.clear()


def _read_file(path: Path, size_bytes: int) -> mmap.mmap:
    buffer = mmap.mmap(-1, max(size_bytes, 1))
    with open(path, "rb") as source:
        read = source.readinto(memoryview(buffer)[:size_bytes])
    if read != size_bytes:
        raise RuntimeError(f"{path} holds {read} bytes, {size_bytes} were written; another process "
                           f"changed the optimizer state file")
    return buffer
