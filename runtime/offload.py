"""A stage's activation offload as its plan names it: checkpoint regions recomputed, nodes swapped.

Both act on runs of the stage's nodes, so the stage is cut once (runtime/regions.py): each
checkpoint region becomes a :class:`runtime.recompute.Checkpointed` submodule, each run of
consecutive swapped nodes a :class:`runtime.swap.Swapped` one; all other nodes run as before.
ZeRO and the parameter/optimizer tiers are not handled here. A spatial stage is cut together
with its fused halo groups (runtime/spatial_stage.py, which uses the same region labels).
"""

from __future__ import annotations

import torch.fx

from planner.plan import OffloadSpec
from runtime import regions
from runtime.recompute import Checkpointed
from runtime.swap import Swapped, SwapSpace


def recompute_regions(spec: OffloadSpec) -> dict[str, tuple[str, ...]]:
    """Label -> nodes of each checkpoint region (``recompute[i]``)."""
    return {f"recompute[{index}]": tuple(region) for index, region in enumerate(spec.recompute)}


def swap_runs(module: torch.fx.GraphModule, spec: OffloadSpec) -> dict[str, tuple[str, ...]]:
    """Label -> nodes of each run of swapped nodes consecutive in the stage's order (``swap[i]``)."""
    swapped = set(spec.swap)
    runs: list[list[str]] = []
    previous = None
    for node in module.graph.nodes:
        if node.name in swapped:
            if previous not in swapped:
                runs.append([])
            runs[-1].append(node.name)
        previous = node.name
    missing = sorted(swapped - {name for run in runs for name in run})
    if missing:
        runs.append(missing)  # not nodes of the stage: regions.check refuses them by name
    return {f"swap[{index}]": tuple(run) for index, run in enumerate(runs)}


def check_offload(module: torch.fx.GraphModule, spec: OffloadSpec, *, stage: int) -> None:
    """Refuse (before any work, alike on every rank) regions the stage cannot be cut into."""
    regions.check(module, {**recompute_regions(spec), **swap_runs(module, spec)}, stage=stage)


def offload_stage(module: torch.fx.GraphModule, spec: OffloadSpec, space: SwapSpace, *,
                  stage: int) -> torch.fx.GraphModule:
    """``module`` with its checkpoint regions recomputed and its swapped nodes' activations swapped
    (``module`` itself when the stage offloads no activations)."""
    recomputed, swapped = recompute_regions(spec), swap_runs(module, spec)
    if not recomputed and not swapped:
        return module
    split, names = regions.cut(module, {**recomputed, **swapped}, stage=stage)
    for label in recomputed:
        setattr(split, names[label], Checkpointed(split.get_submodule(names[label])))
    for label in swapped:
        setattr(split, names[label], Swapped(split.get_submodule(names[label]), space))
    return split
