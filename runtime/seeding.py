"""Seeds derived from a base seed and a key, the same in every process (no Python ``hash``)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

_SEED_BITS = 2**63 - 1  # a generator's seed: 63 bits
_WORD = 2**64 - 1


def derive_seed(seed: int, *key: object) -> int:
    """A 63-bit seed for ``key`` under ``seed``; equal in every process and on every run.

    >>> derive_seed(0, "init", "layer1.0.conv1") == derive_seed(0, "init", "layer1.0.conv1")
    True
    """
    text = "\x1f".join(str(part) for part in (seed, *key))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & _SEED_BITS


def generator(seed: int, *key: object) -> torch.Generator:
    """A CPU generator seeded by :func:`derive_seed`."""
    return torch.Generator().manual_seed(derive_seed(seed, *key))


@contextlib.contextmanager
def seeded(seed: int, *key: object, device: torch.device | None = None) -> Iterator[None]:
    """Run the block with the CPU generator (and ``device``'s, if CUDA) seeded for ``key``; restore after."""
    cuda = [] if device is None or device.type != "cuda" else [
        device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda):
        value = derive_seed(seed, *key)
        torch.default_generator.manual_seed(value)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(value)
        yield


def mix_seed(seed: int, number: int) -> int:
    """A 63-bit seed from ``seed`` and ``number`` by one splitmix64 step: a few integer operations, equal in
    every process, and far apart for neighbouring numbers.

    >>> mix_seed(7, 1) == mix_seed(7, 1), mix_seed(7, 1) != mix_seed(7, 2), 0 <= mix_seed(7, 1) < 2**63
    (True, True, True)
    """
    word = (seed + (number + 1) * 0x9E3779B97F4A7C15) & _WORD
    word = ((word ^ (word >> 30)) * 0xBF58476D1CE4E5B9) & _WORD
    word = ((word ^ (word >> 27)) * 0x94D049BB133111EB) & _WORD
    return (word ^ (word >> 31)) & _SEED_BITS


class ForwardSeeds:
    """The random-number generators' seed of each forward a rank runs, by (step, stage, micro-batch), equal
    in every process (a replica's stage, a recomputed forward and a resumed run draw the same masks).

    The (stage, micro-batch) part is derived once (:func:`derive_seed`) and the step mixed in
    (:func:`mix_seed`), and the caller's generator state is saved once around a whole step (:meth:`step`):
    deriving the whole key and saving and restoring the state around each forward cost 0.1 ms a forward
    on this machine's CPU (a cold interpreter and cache after the compute before it), 1% of a small GPT's
    pipeline step.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        self._cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        self._bases: dict[tuple[int, int], int] = {}

    def value(self, step: int, stage: int, microbatch: int) -> int:
        """The seed of stage ``stage``'s forward of (global) micro-batch ``microbatch`` in step ``step``."""
        base = self._bases.get((stage, microbatch))
        if base is None:
            base = self._bases[stage, microbatch] = derive_seed(self.seed, "forward", stage, microbatch)
        return mix_seed(base, step)

    def apply(self, step: int, stage: int, microbatch: int) -> None:
        """Seed the CPU generator (and the device's) for that forward; inside :meth:`step`."""
        value = self.value(step, stage, microbatch)
        torch.default_generator.manual_seed(value)
        for index in self._cuda:
            torch.cuda.default_generators[index].manual_seed(value)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The caller's generator states, restored when the step's forwards are done."""
        with torch.random.fork_rng(devices=self._cuda):
            yield
