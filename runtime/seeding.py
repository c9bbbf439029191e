"""Seeds derived from a base seed and a key, the same in every process (no Python ``hash``)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch


def derive_seed(seed: int, *key: object) -> int:
    """A 63-bit seed for ``key`` under ``seed``; equal in every process and on every run.

    >>> derive_seed(0, "init", "layer1.0.conv1") == derive_seed(0, "init", "layer1.0.conv1")
    True
    """
    text = "\x1f".join(str(part) for part in (seed, *key))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


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
