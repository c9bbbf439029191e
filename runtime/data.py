"""Synthetic training data and loss for `python -m runtime`: deterministic per (seed, step, sample).

* Float inputs are standard normal; integer inputs are uniform in ``[0, high)`` where ``high``
  is the smallest ``num_embeddings`` of the embeddings reading that input, directly or reshaped
  (2 if none does).
* The loss follows the model output ``y`` of one micro-batch as cost_models/loss.py decides it
  (cross-entropy for logits, mean squared error otherwise); class targets are uniform over the
  classes, regression targets standard normal.
* Sample ``i`` of step ``k``'s global batch draws its inputs and its targets from generators
  seeded by ``(seed, "inputs"|"targets", k, i)``. The data is a function of the global sample
  index alone: micro-batch ``j`` of size ``b`` (``j = replica x micro-batches + m``, as
  runtime/microbatch.py cuts a global batch) holds samples ``j b`` to ``j b + b - 1``, so plans
  that cut the same global batch differently (data-parallel degree, micro-batch size) train on
  the same samples, any rank can make exactly the part it needs, and a resumed run sees the data
  an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from cost_models.errors import RuntimeSetupError
from cost_models.loss import TrainingLoss, training_loss
from runtime.microbatch import Microbatch
from runtime.seeding import generator
from runtime.values import ValueKind, ValueSpec

_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)  # keep the indices' values


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of one micro-batch (batch dimension first): shape, dtype, and for integers the
    exclusive upper bound."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    high: int = 2

    @property
    def batch_size(self) -> int:
        return self.shape[0]

    def draw_sample(self, rng: torch.Generator) -> torch.Tensor:
        """One sample (the shape without its batch dimension)."""
        if self.dtype.is_floating_point:
            return torch.randn(self.shape[1:], generator=rng, dtype=self.dtype)
        return torch.randint(0, self.high, self.shape[1:], generator=rng, dtype=self.dtype)


@dataclass(frozen=True)
class SyntheticTask:
    """The loss of one micro-batch (cost_models/loss.py decides it from the output) and its targets."""

    loss: TrainingLoss
    target: TensorSpec

    @property
    def kind(self) -> str:
        return self.loss.kind

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(output, target)


def synthetic_task(output: ValueSpec) -> SyntheticTask:
    """The training loss of the model's output (one tensor), with targets to draw for it."""
    if output.kind is not ValueKind.TENSOR or output.dtype is None:
        raise RuntimeSetupError(f"synthetic training needs a model returning one tensor, but it "
                                f"returns a {output.kind.value}; train it from your own script "
                                f"with runtime.Executor and your loss")
    loss = training_loss(output.shape, output.dtype)
    return SyntheticTask(loss, TensorSpec(loss.target_shape, loss.target_dtype, loss.classes or 2))


def input_specs(traced: torch.fx.GraphModule, specs: dict[str, ValueSpec]) -> tuple[TensorSpec, ...]:
    """One micro-batch of every model input, with integer ranges read from the embeddings."""
    inputs = []
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            spec = specs[node.name]
            assert spec.dtype is not None
            inputs.append(TensorSpec(spec.shape, spec.dtype, _index_bound(traced, node)))
    return tuple(inputs)


def _index_bound(traced: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    return min(_embedding_rows(traced, node), default=2)


def _embedding_rows(traced: torch.fx.GraphModule, node: torch.fx.Node) -> list[int]:
    """The rows of every embedding that looks ``node`` up, directly or after a reshape of it."""
    rows = []
    for user in node.users:
        weight: object = None
        if user.op == "call_module":
            module = traced.get_submodule(str(user.target))
            if isinstance(module, nn.Embedding) and user.args[0] is node:
                rows.append(module.num_embeddings)
        elif user.op == "call_function" and user.target is F.embedding and user.args[0] is node:
            weight = user.args[1]
        elif (user.op == "call_function" and user.target is torch.ops.aten.embedding.default
              and user.args[1] is node):
            weight = user.args[0]  # torch.export's form: (weight, indices)
        elif user.op == "call_function" and user.target in _RESHAPES and user.args[0] is node:
            rows += _embedding_rows(traced, user)
        if isinstance(weight, torch.fx.Node) and weight.op == "get_attr":
            rows.append(_attr_rows(traced, str(weight.target)))
    return rows


def _attr_rows(traced: torch.fx.GraphModule, target: str) -> int:
    value: Any = traced
    for part in target.split("."):
        value = getattr(value, part)
    return int(value.shape[0])


@dataclass(frozen=True)
class SyntheticData:
    """Deterministic samples: ``samples(step, first, count)`` is the same in every process and plan."""

    inputs: tuple[TensorSpec, ...]
    task: SyntheticTask
    seed: int

    def microbatch(self, step: int, index: int, *, inputs: bool = True, targets: bool = True) -> Microbatch:
        """Micro-batch ``index`` of the global batch of ``step`` (the specs' batch size each)."""
        size = self.task.target.batch_size
        return self.samples(step, index * size, size, inputs=inputs, targets=targets)

    def samples(self, step: int, first: int, count: int, *, inputs: bool = True,
                targets: bool = True) -> Microbatch:
        """Samples ``first`` to ``first + count - 1`` of the global batch of ``step``, stacked."""
        indices = range(first, first + count)
        made_inputs = None
        if inputs:
            drawn = [self._inputs(step, index) for index in indices]
            made_inputs = tuple(torch.stack(column) for column in zip(*drawn))
        made_targets = None
        if targets:
            target = self.task.target
            made_targets = torch.stack([target.draw_sample(generator(self.seed, "targets", step, index))
                                        for index in indices])
        return Microbatch(made_inputs, made_targets)

    def _inputs(self, step: int, index: int) -> tuple[torch.Tensor, ...]:
        rng = generator(self.seed, "inputs", step, index)
        return tuple(spec.draw_sample(rng) for spec in self.inputs)
