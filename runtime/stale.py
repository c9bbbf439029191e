"""WPipe's weight stash: the stages of the first group compute each step on weights one update old.

Under a WPipe plan (planner/schedules/generate.py) a first-group stage runs forwards for the next
step (period p + 1) before its optimizer steps on this step's gradients, so the update rule is

    W0(p + 1) = W0(p) - step(g0(p)),   g0(p) the gradient of period p's loss at W0(p - 1)

(W0(-1) = W0(0)), while the second group updates as usual. Period p's forwards and backwards on such a
stage must all read W0(p - 1), whichever step runs them, so the stage keeps two copies of its module
besides the one the optimizer steps: copy ``p % 2`` holds W0(p - 1) for period p. Autograd saves a
copy's own parameters, so period p + 1's graphs are untouched when the optimizer updates the stepped
module; after the update the copy period p used (all of its backwards are done) becomes period
p + 2's, loaded with the new weights. A copy shares the stepped module's buffers (batch-norm
statistics update once, in forward order) and collects its weight gradients, which move to the
stepped parameters before the all-reduce and the step.

torch's optimizers update their parameters in place and checkpointed regions re-run the module in the
backward, so versions are whole module copies rather than swapped tensors: a recomputed region reads
the weights its forward read.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from runtime.stages import LocalStage


class WeightVersions:
    """The two stashed copies of each first-group stage on this rank (no stage: a no-op)."""

    def __init__(self, stages: Mapping[int, LocalStage], stale: Iterable[int]) -> None:
        self._copies: dict[int, tuple[_Copy, _Copy]] = {
            index: (_Copy.of(stages[index]), _Copy.of(stages[index])) for index in stale if index in stages}
        self._stages = stages

    @property
    def stale_stages(self) -> tuple[int, ...]:
        return tuple(self._copies)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the stashed copies hold (their weights and gradients; the buffers are shared)."""
        held = [t for pair in self._copies.values() for c in pair
                for t in (*c.module.parameters(), *(v for v in c.attrs.values() if v.requires_grad))]
        return held + [t.grad for t in held if t.grad is not None]

    def module(self, stage: int, period: int) -> nn.Module:
        """The module period ``period``'s forward of ``stage`` runs (its stash copy, or the stage's own)."""
        if stage not in self._copies:
            return self._stages[stage].module
        return self._copies[stage][period % 2].module

    def attrs(self, stage: int, period: int) -> dict[str, torch.Tensor]:
        """The get_attr inputs (weights another stage of this rank owns) period ``period`` reads."""
        if stage not in self._copies:
            return self._stages[stage].attrs
        return self._copies[stage][period % 2].attrs

    def weights(self, stage: int, period: int) -> list[torch.Tensor]:
        """What a weight-gradient pass (W) of period ``period`` differentiates on ``stage``."""
        if stage not in self._copies:
            return self._stages[stage].weights()
        held = self._copies[stage][period % 2]
        tensors = [*held.module.parameters(), *held.attrs.values()]
        return list({id(t): t for t in tensors if t.requires_grad}.values())

    def collect_gradients(self, stage: int, period: int) -> None:
        """Move period ``period``'s weight gradients from its copy to the stepped parameters (idempotent)."""
        if stage not in self._copies:
            return
        held, own = self._copies[stage][period % 2], self._stages[stage]
        pairs = [*zip(held.module.parameters(), own.module.parameters()),
                 *((held.attrs[name], own.attrs[name]) for name in held.attrs)]
        for stashed, stepped in pairs:
            if stashed.grad is not None:
                stepped.grad = stashed.grad if stepped.grad is None else stepped.grad + stashed.grad
                stashed.grad = None

    def stashed(self, stage: int, period: int) -> dict[str, torch.Tensor] | None:
        """The weights period ``period``'s forwards of ``stage`` read, W0(period - 1), by name (``module.``
        its module's parameters, ``attr.`` its weight attrs); None for a stage that computes on its own."""
        if stage not in self._copies:
            return None
        held = self._copies[stage][period % 2]
        return {**{f"module.{name}": t.detach() for name, t in held.module.named_parameters()},
                **{f"attr.{name}": t.detach() for name, t in held.attrs.items() if t.requires_grad}}

    def resume(self, stage: int, period: int, stashed: dict[str, torch.Tensor]) -> None:
        """Continue at period ``period`` from a checkpoint: its stashed weights (:meth:`stashed`) become
        period ``period``'s version, and the stage's own weights, just loaded, period ``period + 1``'s."""
        held = self._copies[stage][period % 2]
        mine = self.stashed(stage, period)
        assert mine is not None
        if set(stashed) != set(mine):
            missing, extra = sorted(set(mine) - set(stashed)), sorted(set(stashed) - set(mine))
            raise ValueError(f"the stashed weights lack {len(missing)} of this stage's (first "
                             f"{missing[0] if missing else '-'}) and hold {len(extra)} it lacks (first "
                             f"{extra[0] if extra else '-'})")
        with torch.no_grad():
            for name, tensor in mine.items():
                tensor.copy_(stashed[name])
        held.clear_grads()
        self._copies[stage][(period + 1) % 2].load(self._stages[stage])

    def after_update(self, stage: int, period: int) -> None:
        """The stage stepped on period ``period``'s gradients: the copy that period used becomes period
        ``period + 2``'s, holding the new weights."""
        if stage in self._copies:
            self._copies[stage][period % 2].load(self._stages[stage])


class _Copy:
    """One stashed version of a stage: a copy of its module (sharing its buffers) and of its weight attrs."""

    def __init__(self, module: nn.Module, attrs: dict[str, torch.Tensor]) -> None:
        self.module, self.attrs = module, attrs

    @classmethod
    def of(cls, stage: LocalStage) -> _Copy:
        module = copy.deepcopy(stage.module)
        for name, buffer in stage.module.named_buffers():
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = buffer
        attrs = {name: value.detach().clone().requires_grad_(value.requires_grad) if value.requires_grad
                 else value for name, value in stage.attrs.items()}
        return cls(module, attrs)

    def load(self, stage: LocalStage) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.module.parameters(), stage.module.parameters()):
                mine.copy_(theirs)
            for name, value in self.attrs.items():
                if value.requires_grad:
                    value.copy_(stage.attrs[name])
        self.clear_grads()

    def clear_grads(self) -> None:
        for tensor in (*self.module.parameters(), *self.attrs.values()):
            tensor.grad = None
