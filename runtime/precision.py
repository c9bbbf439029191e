"""Mixed precision (fp16, bf16) as the planner's memory model counts it: 16-bit weights and gradients
on the device, an fp32 master copy of every trainable parameter stepped by the optimizer (so its
state is fp32 too), and for fp16 a dynamic loss scale that every rank agrees on.

Conventions (the single-process reference in tests/dist/precision_cases.py does the same):

* The model is built and initialised in float32 (planner.preflight.build_dtype); the masters are
  copies of those weights (:func:`fp32_copies`, taken before the cast; the masters themselves, their
  optimizer and the copies down and back are each stage's runtime/stage_optimizer.py
  ``StageOptimizer``, on whichever tier and ZeRO stage the plan puts them), then the whole model is cast to the 16-bit dtype and computes in it
  directly (no autocast: autocast would hold fp32 weights and fp32 gradients on the device, not
  the 2-byte ones the plan's memory model assumes). Floating model inputs are cast to 16 bits.
* The loss is computed in float32 on the model output cast to float32; under fp16 it is
  multiplied by the loss scale before backward (each micro-batch, last stage only: the gradients
  sent back to earlier stages carry the scale already). Gradients accumulate in 16 bits.
* At the step (the rank's last ``OPTIMIZER_STEP``, when the gradients of all its stages are
  summed over replicas and tied copies) the 16-bit gradients become the masters' fp32 gradients,
  unscaled; a non-finite value on any rank (a found-inf flag all-reduced with MAX over the whole
  world) skips the step on every rank. The scale follows ``torch.amp.GradScaler``'s rule and
  defaults: halved after a skipped step, doubled after ``growth_interval`` good steps in a row,
  computed with the very kernels GradScaler runs.
* bf16 has fp32's exponent range: no loss scale, no found-inf check, every step is taken.

Why not ``torch.amp.GradScaler`` itself: it decides to skip ``optimizer.step`` from the found-inf
flags of the gradients it unscaled, which are this rank's only, and keeps them in private
per-optimizer state; a pipeline must skip on every rank when any rank overflows, which needs the
flag all-reduced between the unscale and the skip decision, and GradScaler has no public place
for that. :class:`LossScaler` keeps its state dict format (``state_dict()`` loads into a GradScaler
and back).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from cost_models.errors import CheckpointError
from cost_models.memory import Precision
from runtime.comm import wait_for
from runtime.stages import LocalStage

if TYPE_CHECKING:
    from runtime.stage_optimizer import StageOptimizer

MASTER_DTYPE = torch.float32


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype weights, gradients and activations have on the device.

    >>> compute_dtype(Precision.BF16)
    torch.bfloat16
    """
    return getattr(torch, precision.dtype)


@dataclass(frozen=True)
class ScalerOptions:
    """The dynamic loss scale's rule; the defaults are ``torch.amp.GradScaler``'s."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000  # good steps in a row before the scale grows


class LossScaler:
    """The fp16 loss scale and its growth tracker, updated as ``torch.amp.GradScaler`` does.

    Example::

        scaler = LossScaler(ScalerOptions(), torch.device("cpu"))
        found_inf = scaler.found_inf(grads16)       # 1.0 if any gradient is inf or NaN
        scaler.update(found_inf)                     # after all-reducing found_inf
    """

    def __init__(self, options: ScalerOptions, device: torch.device) -> None:
        self.options = options
        self.scale = torch.full((), options.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    def inv_scale(self) -> torch.Tensor:
        """1/scale, as GradScaler computes it."""
        return self.scale.double().reciprocal().float()

    def unscale_(self, grads: list[torch.Tensor], inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Multiply fp32 ``grads`` in place by ``inv_scale`` (default 1/scale now); returns the found-inf
        flag (0.0 or 1.0)."""
        return self._checked(grads, self.inv_scale() if inv_scale is None else inv_scale)

    def found_inf(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The found-inf flag of ``grads`` (any dtype), left as they are: a value is inf or NaN in 16 bits
        exactly when it is so in fp32 and after unscaling (1/scale is finite, fp32 far wider than fp16)."""
        return self._checked(grads, torch.ones((), device=self.scale.device))

    def _checked(self, grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
        """``grads`` times ``inv_scale`` in place, and whether any is inf or NaN. Gradients may lie on
        several devices (masters on the host for some stages): each device's are checked there and
        their flags combined on the scale's device."""
        found_inf = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for device, group in by_device.items():
            found = found_inf if device == found_inf.device else torch.zeros_like(found_inf, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale.to(device))
            if found is not found_inf:
                torch.maximum(found_inf, found.to(found_inf.device), out=found_inf)
        return found_inf

    def update(self, found_inf: torch.Tensor) -> None:
        """Back off after an overflow, grow after ``growth_interval`` good steps (GradScaler's kernel)."""
        options = self.options
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, options.growth_factor,
                                 options.backoff_factor, options.growth_interval)

    def state_dict(self) -> dict[str, Any]:
        """In ``torch.amp.GradScaler.state_dict()``'s format."""
        options = self.options
        return {"scale": float(self.scale.item()), "growth_factor": options.growth_factor,
                "backoff_factor": options.backoff_factor, "growth_interval": options.growth_interval,
                "_growth_tracker": int(self.growth_tracker.item())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.options = dataclasses.replace(self.options, growth_factor=float(state["growth_factor"]),
                                           backoff_factor=float(state["backoff_factor"]),
                                           growth_interval=int(state["growth_interval"]))
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["_growth_tracker"]))


def fp32_copies(stages: Mapping[int, LocalStage]) -> dict[int, list[torch.Tensor]]:
    """Each stage's parameters copied to fp32 (taken before :func:`cast_model`): its masters' start."""
    return {index: [p.detach().to(MASTER_DTYPE, copy=True) for p in stage.params.values()]
            for index, stage in stages.items()}


class MixedPrecision:
    """This rank's loss scale and the deferred step of its stages' fp32 masters.

    The masters, their optimizers and the copies between masters and 16-bit parameters belong to
    each stage's :class:`runtime.stage_optimizer.StageOptimizer` (built from :func:`fp32_copies`).
    The executor calls :meth:`step` at every ``OPTIMIZER_STEP``; the step itself is taken at the
    last of this rank's stages (``stepped``), once every stage's gradients are final, so that one
    world-wide found-inf all-reduce decides for all of them.
    """

    def __init__(self, precision: Precision, states: Mapping[int, StageOptimizer | None],
                 *, stepped: AbstractSet[int], device: torch.device, timeout_s: float,
                 scaler: ScalerOptions | None = None) -> None:
        if not precision.master_weights:
            raise ValueError(f"precision {precision.value} keeps no master weights; mixed precision is "
                             f"fp16 or bf16")
        self.precision = precision
        self.dtype = compute_dtype(precision)
        self.stepped = frozenset(stepped)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.scaler = LossScaler(scaler or ScalerOptions(), device) if precision is Precision.FP16 else None
        self.states = {index: state for index, state in states.items() if state is not None}
        self.skipped_steps = 0
        self._pending: set[int] = set(self.stepped)

    # ------------------------------------------------------------ forward side
    def input_dtype(self, value: torch.Tensor) -> torch.dtype:
        """The dtype a model input enters in: floats in the compute dtype, integers as they are."""
        return self.dtype if value.is_floating_point() else value.dtype

    def loss_input(self, output: Any) -> Any:
        """The model output with floating tensors in float32, so that the loss is computed in fp32."""
        return torch.fx.node.map_aggregate(output, lambda value: value.to(MASTER_DTYPE) if isinstance(
            value, torch.Tensor) and value.is_floating_point() else value)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale (fp16), what backward starts from; bf16 is not scaled."""
        return loss if self.scaler is None else loss * self.scaler.scale

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else float(self.scaler.scale.item())

    # --------------------------------------------------------------- the step
    def step(self, stage: int) -> tuple[int, ...]:
        """``OPTIMIZER_STEP`` of ``stage``: the step of all this rank's stages once it is the last; returns the
        stages whose step (taken, or skipped by the loss scale) is over: none before the last, all at it."""
        if stage not in self._pending:
            raise RuntimeError(f"OPTIMIZER_STEP of stage {stage} came twice in a step, or for a stage "
                               f"without one in the program (expected {sorted(self.stepped)})")
        self._pending.discard(stage)
        if self._pending:
            return ()
        self._pending = set(self.stepped)
        self._step_all()
        return tuple(sorted(self.stepped))

    def _step_all(self) -> None:
        unscale = None
        if self.scaler is not None:  # overflow checked on the 16-bit gradients, unscaled in fp32 by the step
            # the scale these gradients carry, taken before the update
            unscale = functools.partial(self.scaler.unscale_, inv_scale=self.scaler.inv_scale())
            grads = [grad for state in self.states.values() for grad in state.gradients()]
            found_inf = self.scaler.found_inf(grads)
            work = dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, async_op=True)
            wait_for(work, self.timeout, "the loss scale's found-inf all-reduce")
            self.scaler.update(found_inf)
            if found_inf.item() > 0:
                self.skipped_steps += 1
                for state in self.states.values():
                    state.skip()
                return
        for state in self.states.values():
            state.step(unscale)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self, stage: int) -> dict[str, Any]:
        """What a checkpoint holds for ``stage``: its whole fp32 masters (by name) and the loss
        scaler's state (collective on a ZeRO stage: every replica calls it)."""
        state = self.states.get(stage)
        masters = {} if state is None else dict(zip(state.names, state.full_masters()))
        return {"precision": self.precision.value, "masters": masters,
                "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load_state_dict(self, stage: int, saved: Mapping[str, Any] | None) -> list[torch.Tensor] | None:
        """Check ``stage``'s saved precision state and load the scaler; the saved whole masters in
        the stage's parameter order (for ``StageOptimizer.restore``), None if it has none."""
        if saved is None or saved.get("precision") != self.precision.value:
            written = "no master weights" if saved is None else f"precision {saved.get('precision')}"
            raise CheckpointError(f"stage {stage}'s checkpoint holds {written} but this plan trains in "
                                  f"{self.precision.value}; resume with the plan that wrote it, or use "
                                  f"another --checkpoint-dir")
        state = self.states.get(stage)
        names = [] if state is None else state.names
        if set(saved["masters"]) != set(names):
            raise CheckpointError(f"stage {stage}'s checkpoint holds masters of "
                                  f"{sorted(set(saved['masters']) ^ set(names))[:3]} which this "
                                  f"stage does not have alike; resume with the plan that wrote it")
        if self.scaler is not None and saved["scaler"] is not None:
            self.scaler.load_state_dict(saved["scaler"])
        return [saved["masters"][name] for name in names] if state is not None else None


def cast_model(model: nn.Module, precision: Precision) -> None:
    """Cast the model's floating parameters and buffers to the compute dtype, in place.

    Parameters keep their identity (``Module.to`` assigns ``.data``), so the stages, the traced
    graph and tied aliases all see the 16-bit tensors; meta tensors (other ranks' stages) are
    cast too, so shape propagation gives the 16-bit activations that travel between stages.
    """
    model.to(compute_dtype(precision))
