"""Activation swapping: the saved tensors of a stage's swapped nodes wait for the backward on the host.

The swapped nodes run under ``torch.autograd.graph.saved_tensors_hooks`` (:class:`Swapped`): each
tensor autograd saves is copied to host memory (on CUDA into pinned memory, ``non_blocking`` on a
copy stream of its own, an event recorded) and filed under the (stage, micro-batch) being run.
The program's actions then move it:

* ``SWAP_OUT(s, m)`` (:meth:`SwapSpace.wait_out`) waits for micro-batch m's copies to the host and
  drops the device tensors, whose memory is then free;
* ``SWAP_IN(s, m)`` (:meth:`SwapSpace.prefetch`) starts the copies back to the device, one
  backward ahead of ``B(s, m)``;
* the backward unpacks the prefetched tensor (waiting for its copy), or copies it back then if no
  prefetch was made.

Parameters and buffers are never swapped: autograd saves them by reference, so a tensor whose
storage is one of theirs is kept as it is. On the CPU, which stands in for a GPU, the same code
runs with no-op streams (runtime/streams.py): the host copy is a separate CPU tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn

from runtime.memory import storage_key
from runtime.streams import Event, current_stream, keep_alive, new_stream, use_stream

Key = tuple[int, int]  # (stage, micro-batch)


class HostCopy:
    """One saved tensor: its host copy, and the device tensor while it still exists."""

    def __init__(self, device_tensor: torch.Tensor, host: torch.Tensor, copied: Event) -> None:
        self.device_tensor: torch.Tensor | None = device_tensor  # until SWAP_OUT has waited for the copy
        self.host = host
        self.copied = copied
        self.fetched: torch.Tensor | None = None  # on the device again, after SWAP_IN
        self.arrived: Event | None = None


class SwapSpace:
    """This rank's swapped activations, per (stage, micro-batch), from the forward to the backward.

    Example (what the executor does for one micro-batch of a stage that swaps)::

        with space.forward((stage, m)):
            outputs = stage_module(*inputs)      # its Swapped regions copy saved tensors out
        space.wait_out((stage, m))               # SWAP_OUT
        space.prefetch((stage, m))               # SWAP_IN
        torch.autograd.backward(...)             # unpacks the prefetched tensors
        space.release((stage, m))
    """

    def __init__(self, device: torch.device, kept_storages: Collection[int]) -> None:
        self.device = device
        self.stream = new_stream(device)
        self.kept_storages = frozenset(kept_storages)  # storage keys of parameters and buffers
        self.copies: dict[Key, list[HostCopy]] = {}
        self.step_bytes = 0  # bytes copied to the host in the current step
        self._key: Key | None = None

    @contextlib.contextmanager
    def forward(self, key: Key) -> Iterator[None]:
        """The forward of ``key`` runs inside: swapped regions file their saved tensors under it."""
        self._key = key
        try:
            yield
        finally:
            self._key = None

    @contextlib.contextmanager
    def packing(self) -> Iterator[None]:
        """Saved tensors of the enclosed ops go to the host (used by :class:`Swapped`)."""
        if self._key is None:
            raise RuntimeError("a swapped region ran outside SwapSpace.forward(key)")
        copies = self.copies.setdefault(self._key, [])

        def pack(tensor: torch.Tensor) -> torch.Tensor | HostCopy:
            if tensor.device.type == "meta" or storage_key(tensor) in self.kept_storages:
                return tensor
            copies.append(self._to_host(tensor))
            return copies[-1]

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _to_host(self, tensor: torch.Tensor) -> HostCopy:
        host = torch.empty_like(tensor, device="cpu", pin_memory=self.device.type == "cuda")
        self.stream.wait_stream(current_stream(self.device))  # the tensor is computed on the current stream
        with use_stream(self.stream):
            host.copy_(tensor.detach(), non_blocking=True)
            copied = self.stream.record_event()
        keep_alive(tensor, self.stream)
        self.step_bytes += host.untyped_storage().nbytes()
        return HostCopy(tensor, host, copied)

    def _unpack(self, packed: torch.Tensor | HostCopy) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.device_tensor is not None:  # the backward came before SWAP_OUT
            return packed.device_tensor
        fetched, arrived = packed.fetched, packed.arrived
        if fetched is None or arrived is None:  # no SWAP_IN: copy it back now
            return torch.empty_like(packed.host, device=self.device).copy_(packed.host)
        current_stream(self.device).wait_event(arrived)
        packed.fetched = packed.arrived = None  # the backward holds it from here on
        return fetched

    def wait_out(self, key: Key) -> None:
        """SWAP_OUT: wait for ``key``'s copies to the host; the device tensors can then be freed."""
        for copy in self.copies.get(key, ()):
            copy.copied.synchronize()
            copy.device_tensor = None

    def prefetch(self, key: Key) -> None:
        """SWAP_IN: start copying ``key``'s saved tensors back to the device."""
        self.stream.wait_stream(current_stream(self.device))  # device memory is allocated on the current stream
        for copy in self.copies.get(key, ()):
            if copy.device_tensor is not None or copy.fetched is not None:
                continue
            fetched = torch.empty_like(copy.host, device=self.device)
            with use_stream(self.stream):
                fetched.copy_(copy.host, non_blocking=True)
                copy.arrived = self.stream.record_event()
            keep_alive(fetched, self.stream)
            copy.fetched = fetched

    def release(self, key: Key) -> None:
        """``key``'s backward ran: its host copies are no longer needed."""
        self.copies.pop(key, None)

    def new_step(self) -> None:
        self.copies.clear()
        self.step_bytes = 0


class Swapped(nn.Module):
    """Runs ``region`` with its saved tensors sent to the host by ``space``."""

    def __init__(self, region: nn.Module, space: SwapSpace) -> None:
        super().__init__()
        self.region = region
        self.space = space

    def forward(self, *args: Any) -> Any:
        with self.space.packing():
            return self.region(*args)
