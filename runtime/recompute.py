"""Activation recomputation: a stage's checkpoint regions run under non-reentrant ``checkpoint``.

A region's forward keeps only its inputs; its saved activations are dropped and recomputed when
the backward reaches them (``torch.utils.checkpoint``, ``use_reentrant=False``), with the random
state of the forward restored, so dropout draws the same mask twice.

Recomputation runs the region's modules again in training mode, so a batch-norm inside would
update its running statistics a second time with the same batch. The recomputation therefore runs
with every buffer of the region restored afterwards to what it held before it: running statistics
change once per forward, as without recomputation.

A region that communicates (a spatial stage's halo exchanges and synchronised batch-norms) is
recomputed whole (``communicates=True``). By default the recomputation stops once it has
recomputed every tensor the backward needs, and where that happens depends on the rank: a tile at
the image border pads and saves different tensors than its neighbour. One tile would then stop
before a halo exchange that its neighbour, recomputing further, posts and waits for, and both
hang. Recomputed whole, every tile of the group runs the same exchanges and all-reduces in the
same order as in the forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from runtime.regions import cut


class Checkpointed(nn.Module):
    """Runs ``region`` under non-reentrant activation checkpointing (see the module docstring);
    ``communicates``: the region exchanges halos or all-reduces, so it is recomputed whole."""

    def __init__(self, region: nn.Module, *, communicates: bool = False) -> None:
        super().__init__()
        self.region = region
        self.communicates = communicates

    def forward(self, *args: Any) -> Any:
        with set_checkpoint_early_stop(not self.communicates):
            return checkpoint(self.region, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=self._contexts)

    def _contexts(self) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        """(around the forward, around the recomputation)."""
        return contextlib.nullcontext(), BuffersRestored(self.region)


class BuffersRestored:
    """Around each recomputation of a region: on leaving, every buffer of ``module`` is put back as it was on
    entering (in place, same tensors). Re-enterable, unlike a generator's context: a split backward (ZB-H1)
    recomputes a region twice, in its I and in its W, with the one context its forward made."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.saved: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def __enter__(self) -> None:
        self.saved.append([(buffer, buffer.detach().clone()) for buffer in self.module.buffers()])

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buffer, value in self.saved.pop():
                buffer.copy_(value)


def recompute(module: torch.fx.GraphModule, regions: Sequence[Sequence[str]], *,
              stage: int = 0) -> torch.fx.GraphModule:
    """``module`` with each region (a run of its node names) checkpointed; other nodes run as before.

    Example::

        stage = recompute(stage_module, [("blocks_0_ln_2", "blocks_0_mlp_fc", "blocks_0_mlp_gelu")])
        stage(x).sum().backward()      # the region's activations are recomputed here
    """
    split, names = cut(module, {f"recompute[{index}]": tuple(region) for index, region in enumerate(regions)},
                       stage=stage)
    for name in names.values():
        setattr(split, name, Checkpointed(split.get_submodule(name)))
    return split
