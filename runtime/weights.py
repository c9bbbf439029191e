"""Deterministic parameter initialisation keyed by (seed, module name), so any subset of modules
can be materialised on any rank and still equal a single-process model initialised the same way.

Rules (the documented limitation):

* Every module that directly holds a parameter or buffer is initialised by its own
  ``reset_parameters()`` with the CPU generator seeded from ``(seed, qualified module name)``;
  the values are drawn on the CPU, then moved to ``device``, so they do not depend on the device.
* A module without ``reset_parameters()`` gets ``normal(0, 0.02)`` for its direct parameters
  (same seeding); its buffers are zero-filled when they were on the meta device (a module's
  constructor values cannot be recovered from meta tensors) and kept as they are otherwise.
* A model that initialises its own submodules, as every Hugging Face ``transformers`` model does
  with ``model._init_weights(module)``, then has that run on each module too (same seeding): it
  is how such a model fills what it built on the meta device, non-persistent buffers included
  (BERT's ``position_ids``, Llama's rotary ``inv_freq``), so they are the constructor's values,
  not zeros, and its parameters follow the model's own distributions.
* A tensor shared by several modules (tied weights) is initialised by the first module that
  holds it, in ``named_modules()`` order; later holders initialise only their own tensors.
* The values therefore differ from the builder's own constructor initialisation; they equal
  what ``initialize(model, seed)`` gives in one process, which is the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

from runtime.seeding import seeded


def initialize(model: nn.Module, seed: int, *, device: torch.device | str = "cpu",
               modules: Collection[str] | None = None) -> nn.Module:
    """Materialise (from meta) and initialise ``model``'s modules deterministically; returns ``model``.

    ``modules`` limits the work to those qualified module names (a pipeline rank passes the
    modules of its own stages); tensors of other modules stay where they are (e.g. on meta).

    Example::

        model = gpt_tiny(device="meta")
        initialize(model, seed=0)                      # the single-process reference
        initialize(other, seed=0, modules={"wte", "blocks.0.ln_1"})   # one stage's share
    """
    target = torch.device(device)
    selected = None if modules is None else _with_first_holders(model, set(modules))
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(original) -> (original, result)
    own_init = getattr(model, "_init_weights", None)
    for name, module in model.named_modules():
        if (selected is None or name in selected) and _direct_slots(module):
            _initialize_module(module, name, seed, target, done, own_init if callable(own_init) else None)
    return model


def _direct_slots(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    return ([(attr, t, True) for attr, t in module._parameters.items() if t is not None]
            + [(attr, t, False) for attr, t in module._buffers.items() if t is not None])


def _with_first_holders(model: nn.Module, modules: set[str]) -> set[str]:
    """``modules`` plus, for every tensor they hold, the first module holding it (tied weights)."""
    first: dict[int, str] = {}
    extra: set[str] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        for _, tensor, _ in _direct_slots(module):
            holder = first.setdefault(id(tensor), name)
            if name in modules:
                extra.add(holder)
    return modules | extra


def _initialize_module(module: nn.Module, name: str, seed: int, device: torch.device,
                       done: dict[int, tuple[torch.Tensor, torch.Tensor]],
                       own_init: Callable[[nn.Module], None] | None) -> None:
    """Modules come in ``named_modules()`` order, so a tied tensor's first holder is done first.

    ``own_init`` is the model's own initialiser of one submodule (``_init_weights``), if it has one.
    """
    slots = _direct_slots(module)
    tied = {attr: done[id(tensor)][1] for attr, tensor, _ in slots if id(tensor) in done}
    for attr, tensor, is_param in slots:
        # A tied tensor already initialised by its first holder gets a scratch copy, so this
        # module consumes the generator exactly as it does in a full single-process model.
        fresh = torch.empty(tensor.shape, dtype=tensor.dtype) if attr in tied else _on_cpu(tensor)
        _assign(module, attr, fresh, is_param, tensor.requires_grad)
    with seeded(seed, "init", name), torch.no_grad():
        _reset(module)
        if own_init is not None:
            own_init(module)
    for attr, tensor, is_param in slots:
        if attr in tied:
            _assign(module, attr, tied[attr], is_param, tensor.requires_grad)
            continue
        current = (module._parameters if is_param else module._buffers)[attr]
        _assign(module, attr, current.detach().to(device), is_param, tensor.requires_grad)
        done[id(tensor)] = (tensor, (module._parameters if is_param else module._buffers)[attr])


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "meta":
        return torch.zeros(tensor.shape, dtype=tensor.dtype)
    return tensor.detach().to("cpu", copy=True)


def _assign(module: nn.Module, attr: str, value: torch.Tensor, is_param: bool, requires_grad: bool) -> None:
    if is_param:
        module._parameters[attr] = (value if isinstance(value, nn.Parameter)
                                    else nn.Parameter(value, requires_grad=requires_grad))
    else:
        module._buffers[attr] = value


def _reset(module: nn.Module) -> None:
    with torch.no_grad():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
            return
        for tensor in module._parameters.values():
            if tensor is not None:
                tensor.normal_(0.0, 0.02)
