"""Rebuild the planned model, check it is the one planned, split it into stages, materialise a share.

The model is built on the meta device in the plan's precision and traced exactly as the planner
traced it, same node names and fingerprint (planner/preflight.py, which `tessera run` also runs
before launching); it is split with ``torch.fx.passes.split_module`` by the plan's node-to-stage
map, and only the modules this rank's stages use get real weights (:func:`runtime.initialize`,
keyed by module name, so every rank agrees with a single-process model initialised with the
same seed).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
import torch.fx
from torch import nn

from cost_models.errors import RuntimeSetupError
from planner.plan import Plan
from planner.preflight import default_dtype, rebuild_model, trace_checked
from runtime.splitting import split_tupled

__all__ = ["attribute", "canonical_names", "check_materialised", "default_dtype", "holder_modules",
           "on_meta", "rebuild_model", "split_stages", "stage_tensors", "trace_checked"]


def split_stages(traced: torch.fx.GraphModule, model: nn.Module,
                 plan: Plan) -> dict[int, torch.fx.GraphModule]:
    """One GraphModule per part from ``split_module`` (sharing the model's leaf modules)."""
    part_of = plan.part_of()
    split = split_tupled(traced, model, lambda node: part_of[node.name],
                         keep_original_node_name=True)
    modules = {part: getattr(split, f"submod_{part}", None) for part in range(plan.num_parts)}
    empty = sorted(stage for stage, module in modules.items() if module is None)
    if empty:
        raise RuntimeSetupError(f"stages {empty} of the plan contain no computation (only inputs "
                                f"or parameters); re-plan with fewer stages")
    return modules  # type: ignore[return-value]


def stage_tensors(module: torch.fx.GraphModule, model: nn.Module,
                  param_targets: Collection[str]) -> list[torch.Tensor]:
    """The parameters and buffers a stage uses: its submodules' and those read via get_attr."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [attribute(model, target) for target in param_targets]
    return list({id(t): t for t in tensors}.values())


def holder_modules(model: nn.Module, tensors: Sequence[torch.Tensor]) -> set[str]:
    """Qualified names of every module that directly holds one of ``tensors`` (tied aliases too)."""
    wanted = {id(t) for t in tensors}
    return {name for name, module in model.named_modules(remove_duplicate=False)
            if any(id(t) in wanted for t in [*module._parameters.values(), *module._buffers.values()])}


def attribute(model: nn.Module, target: str) -> torch.Tensor:
    """The tensor at ``target`` (a get_attr path such as ``wte.weight``) in ``model``."""
    value: object = model
    for part in target.split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor), f"get_attr {target} is not a tensor"
    return value


def canonical_names(model: nn.Module) -> dict[int, str]:
    """id(parameter or buffer) -> its first qualified name in ``model`` (tied aliases share one)."""
    names: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    return names


def on_meta(tensors: Sequence[torch.Tensor]) -> bool:
    return any(t.device.type == "meta" for t in tensors)


def check_materialised(stage: int, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    wrong = [tuple(t.shape) for t in tensors if t.device != device]
    if wrong:
        raise RuntimeSetupError(f"stage {stage} still has {len(wrong)} tensors off {device} (shapes "
                                f"{wrong[:3]}) after materialisation; the model holds tensors outside "
                                f"modules' parameters and buffers, which the runtime cannot rebuild "
                                f"from meta: build the model with real weights and pass it to Executor",
                                same_on_every_rank=False)
