"""Peak memory per rank: CUDA's allocator peak; on CPU, the allocations of a profiled step.

Two figures on CPU:

* ``peak_bytes`` (what the run report calls measured peak memory, as CUDA's
  ``max_memory_allocated`` does on a GPU): one step is run under the PyTorch profiler with
  ``profile_memory=True``; every CPU tensor allocation and free of that step is replayed in time
  order on top of the model state alive when it began, and the highest point is the peak. It
  includes temporaries inside operators and autograd. The caller's batch is not counted: as on
  a GPU, each micro-batch is copied in when its forward runs (runtime/executor.py).
* ``held_bytes``: the live tensor bytes the runtime itself holds, sampled after every action of
  a profiled step (nothing is tracked in other steps, which therefore run at full speed).

Held-bytes accounting (each storage counted once):

* model state: this rank's parameters and buffers, their gradients, the optimizer state, and
  under mixed precision (runtime/precision.py) the fp32 master weights (with their gradients
  during the step) on top of the 16-bit weights and gradients: 2 + 2 + 4 bytes a parameter plus
  the optimizer state in fp32, as cost_models/memory.py counts it; the host tier's masters and
  state are host memory, left out on a CPU rank too (the executor's ``_model_state``);
* activations: every storage autograd saves for backward during a stage forward (and its
  loss), recorded with saved-tensor hooks from the F of a micro-batch until its B, parameters
  excluded;
* the tensors the executor itself holds: stage inputs (received or local), outputs kept for
  backward, received output gradients, input gradients waiting to be sent, sends in flight.

Temporaries that live only inside one operator or one backward pass are not held bytes; the
profiled peak sees them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from cost_models.allocations import allocated_peak_bytes, allocation_profiler

Key = Any  # (stage, micro-batch)


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class MemoryTracker:
    """This rank's peak memory; on CPU measured in the steps run inside ``profiling``.

    The executor calls ``saving`` around each forward and ``sample`` after each action; both
    do nothing outside a profiled CPU step.
    """

    def __init__(self, device: torch.device, model_state: Callable[[], Iterable[torch.Tensor]]) -> None:
        self.device = device
        self.model_state = model_state
        self.saved: dict[Key, dict[int, int]] = {}
        self.held_bytes = 0
        self.profiled_bytes = 0
        self.active = False  # held bytes are tracked only in profiled steps (no cost otherwise)
        self._state_bytes: dict[int, int] | None = None
        self._param_keys = {storage_key(t) for t in model_state()}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def saving(self, key: Key) -> Iterator[None]:
        """Record the storages autograd saves inside the block as held by ``key`` until released."""
        if not self.active:
            yield
            return
        ledger = self.saved.setdefault(key, {})

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = storage_key(tensor)
            if storage not in self._param_keys:
                ledger[storage] = tensor.untyped_storage().nbytes()
            # an alias without the autograd history: a node saving its own output would otherwise hold it, and
            # through it itself, in a cycle nothing frees where a split backward leaves part of the graph
            # untraversed (ZB-H1's profiled step kept 3.3 MiB a micro-batch of a GPT stage to the step's end)
            return tensor.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    def release(self, key: Key) -> None:
        """Autograd freed what ``key``'s forward saved (its backward ran)."""
        self.saved.pop(key, None)

    def state_changed(self) -> None:
        """Gradients or optimizer state were created or freed; recount model state next sample."""
        self._state_bytes = None

    def model_state_bytes(self) -> int:
        """Bytes of the model state now alive (each storage once): under mixed precision the 16-bit
        weights and gradients, the fp32 masters and the optimizer state over them."""
        return storage_bytes(self.model_state())

    @property
    def peak_bytes(self) -> int:
        """The measured peak: CUDA's allocator peak, or on CPU the profiled step's (held if none)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(self.profiled_bytes, self.held_bytes) if self.profiled_bytes else self.held_bytes

    def sample(self, held: Iterable[torch.Tensor]) -> None:
        """Update the held-bytes peak (in a profiled CPU step; CUDA's allocator keeps its own peak)."""
        if not self.active:
            return
        if self._state_bytes is None:
            self._state_bytes = _storages(self.model_state())
        live = dict(self._state_bytes)
        for ledger in self.saved.values():
            live.update(ledger)
        live.update(_storages(held))
        self.held_bytes = max(self.held_bytes, sum(live.values()))

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        """Profile the CPU allocations of the enclosed step, on top of the model state before it."""
        if self.device.type == "cuda":
            yield
            return
        baseline = self.model_state_bytes()
        self.active, self._state_bytes = True, None
        try:
            with allocation_profiler() as profile:
                yield
        finally:
            self.active = False
            self.saved.clear()
        self.profiled_bytes = max(self.profiled_bytes, baseline + allocated_peak_bytes(profile))


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (meta tensors hold none)."""
    return sum(_storages(tensors).values())


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    return {storage_key(t): t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type != "meta"}
