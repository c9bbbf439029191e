"""The stages this rank runs: submodule, parameters it owns, get_attr tensors and optimizer
(runtime/stage_optimizer.py, made once the process groups exist)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx
from torch import nn

from runtime.build import attribute, canonical_names, stage_tensors
from runtime.dataflow import Dataflow, SourceKind, StageIO

if TYPE_CHECKING:
    from runtime.stage_optimizer import StageOptimizer

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class LocalStage:
    """One stage on this rank. ``params`` are the ones its optimizer steps (each parameter is
    owned by the first of this rank's stages using it); ``attrs`` feed get_attr inputs."""

    index: int  # the schedule's stage
    part: int  # what it computes (plan.stages[part]); two stages of a GEMS mirror compute one part
    module: torch.fx.GraphModule
    io: StageIO
    params: dict[str, nn.Parameter]  # canonical name -> parameter
    attrs: dict[str, torch.Tensor]  # input node name -> tensor
    state: StageOptimizer | None = None  # None for a stage that owns no trainable parameter

    def weights(self) -> list[torch.Tensor]:
        """Every trainable tensor the stage computes with (its own and those another stage of this rank
        owns, tied ones read through get_attr included): what a weight-gradient pass (W) differentiates."""
        tensors = [*self.module.parameters(), *self.attrs.values()]
        return list({id(t): t for t in tensors if t.requires_grad}.values())

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer: over the parameters themselves, or over their master copies."""
        return self.state.optimizer if self.state is not None else None


def param_targets(io: StageIO) -> list[str]:
    return [source.target for source in io.sources.values() if source.kind is SourceKind.PARAM]


def stage_param_names(model: nn.Module, modules: Mapping[int, torch.fx.GraphModule],
                      flow: Dataflow) -> dict[int, set[str]]:
    """Canonical names of the trainable parameters every stage uses (computed on every rank)."""
    names = canonical_names(model)
    return {stage: {names[id(t)] for t in stage_tensors(module, model, param_targets(flow.stages[stage]))
                    if isinstance(t, nn.Parameter) and t.requires_grad}
            for stage, module in modules.items()}


def local_stages(model: nn.Module, modules: Mapping[int, torch.fx.GraphModule], flow: Dataflow,
                 mine: Mapping[int, int]) -> dict[int, LocalStage]:
    """Build this rank's stages (``mine``: stage -> the part it computes; after materialisation);
    their optimizers come later (set-up)."""
    names = canonical_names(model)
    owned: set[int] = set()
    stages = {}
    for stage, part in sorted(mine.items()):
        io = flow.stages[part]
        params = {}
        for tensor in stage_tensors(modules[part], model, param_targets(io)):
            if isinstance(tensor, nn.Parameter) and tensor.requires_grad and id(tensor) not in owned:
                owned.add(id(tensor))
                params[names[id(tensor)]] = tensor
        attrs = {name: attribute(model, source.target) for name, source in io.sources.items()
                 if source.kind is SourceKind.PARAM}
        stages[stage] = LocalStage(stage, part, modules[part], io, params, attrs)
    return stages


def stage_state_tensors(model: nn.Module, stage: LocalStage) -> dict[str, torch.Tensor]:
    """Canonical name -> every parameter and buffer the stage uses (what a checkpoint holds)."""
    names = canonical_names(model)
    return {names[id(t)]: t for t in stage_tensors(stage.module, model, param_targets(stage.io))}
