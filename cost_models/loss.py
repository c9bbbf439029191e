"""The training loss a plan's last stage computes after the model, and how to tell it from the output.

A plan is costed with, and `tessera run` trains with, the loss that follows the model's output ``y`` of
one micro-batch: cross-entropy for logits ``(N, C)`` (class targets ``(N,)``), ``(N, S, V)`` (token
targets ``(N, S)``) and ``(N, C, H, W)`` with ``C >= 2`` (per-pixel targets ``(N, H, W)``); mean squared
error against targets of ``y``'s shape otherwise. A user's own loss (``runtime.Executor``'s ``loss_fn``)
is costed as this one: a few passes over the output, which for a language model's logits is
milliseconds the last stage spends per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_FLOPS_PER_ELEMENT = 5  # cross-entropy: max, subtract, exp, sum, log (as many back); a roofline estimate
CROSS_ENTROPY = "cross_entropy"
MSE = "mse"


@dataclass(frozen=True)
class TrainingLoss:
    """The loss of one micro-batch's output: its kind and its targets' shape, dtype and (for class
    indices) exclusive upper bound."""

    kind: str  # CROSS_ENTROPY or MSE
    target_shape: tuple[int, ...]
    target_dtype: torch.dtype
    classes: int = 0  # class-index targets lie in [0, classes)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.kind == MSE:
            return F.mse_loss(output, target)
        if output.dim() == 3:
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
        return F.cross_entropy(output, target)

    def example_target(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Targets of the right shape and dtype (class 0, or zeros), to time the loss with."""
        return torch.zeros(self.target_shape, dtype=self.target_dtype, device=device)


def loss_memory_bytes(output_numel: int, itemsize: int) -> tuple[int, int]:
    """What the loss after an output of ``output_numel`` elements holds, in elements of ``itemsize`` bytes (the
    loss's dtype: fp32 under mixed precision, where the runtime casts a 16-bit output up before the loss,
    runtime/precision.py): (kept, working).

    ``kept``: what it keeps for its backward, cross-entropy its log-softmax and MSE its difference, one
    output's worth until that micro-batch's backward. ``working``: at its backward, beside what it kept,
    the gradient that reaches it and the gradient it produces, two more. On a bf16 GPT whose logits
    are 3.1 GiB, the fp32 loss's 12 bytes an element came to 9.3 GiB above a plan that counted its
    kept and working bytes at the logits' 2 (measured on an H200 with torch.cuda.max_memory_allocated).

    >>> loss_memory_bytes(1000, 4)
    (4000, 8000)
    """
    kept = output_numel * itemsize
    return kept, 2 * kept


def training_loss(shape: tuple[int, ...], dtype: torch.dtype) -> TrainingLoss:
    """The loss that follows an output of ``shape`` and ``dtype`` (batch dimension first).

    >>> training_loss((4, 64, 2048), torch.float32).kind, training_loss((4, 64, 2048), torch.float32).target_shape
    ('cross_entropy', (4, 64))
    >>> training_loss((4, 1), torch.float32).kind
    'cross_entropy'
    >>> training_loss((4, 1, 8, 8), torch.float32).kind
    'mse'
    """
    shape = tuple(shape)
    if dtype.is_floating_point and len(shape) == 2:
        return TrainingLoss(CROSS_ENTROPY, shape[:1], torch.int64, shape[1])
    if dtype.is_floating_point and len(shape) == 3:
        return TrainingLoss(CROSS_ENTROPY, shape[:2], torch.int64, shape[2])
    if dtype.is_floating_point and len(shape) == 4 and shape[1] >= 2:
        return TrainingLoss(CROSS_ENTROPY, (shape[0], *shape[2:]), torch.int64, shape[1])
    return TrainingLoss(MSE, shape, dtype)
