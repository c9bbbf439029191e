"""Batch-norm over an image split into tiles: statistics all-reduced across the tile group, or per tile.

With ``sync=True`` every rank all-reduces one tensor holding, per channel, the sum and the sum of
squares of the pixels it owns, and the pixel count; mean and (biased) variance are then those of
the whole image batch, and the all-reduce is differentiable (its backward all-reduces the
gradients of those sums), so outputs, input gradients, weight and bias gradients and the running
statistics equal an unpartitioned ``BatchNorm2d`` in training mode.

With ``sync=False`` each tile is normalised with its own mean and variance, as MPI4DL does. That
is cheaper (no collective) but it is a different model: border tiles with dark margins normalise
differently from the centre, results depend on the number of tiles, and each rank's running
statistics track only its own tiles. It does not equal unpartitioned training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

STATS_DTYPE = torch.float64


class _AllReduceSum(torch.autograd.Function):
    """Sum a tensor over the group; the backward sums the gradients the same way."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: torch.Tensor,  # type: ignore[override]
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,  # type: ignore[override]
                 grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)  # type: ignore[attr-defined]
        return total, None


def _moments(owned: torch.Tensor, group: dist.ProcessGroup | None, sync: bool) -> tuple[torch.Tensor, ...]:
    """Per-channel mean, biased variance and pixel count over the owned pixels (of all tiles if sync)."""
    channels = owned.shape[1]
    sums = owned.sum(dim=(0, 2, 3), dtype=STATS_DTYPE)
    squares = (owned * owned).sum(dim=(0, 2, 3), dtype=STATS_DTYPE)
    count = sums.new_full((1,), owned.numel() // channels)
    stats = torch.cat([sums, squares, count])
    if sync:
        stats = _AllReduceSum.apply(stats, group)
    sums, squares, count = stats[:channels], stats[channels:2 * channels], stats[2 * channels]
    mean = sums / count
    return mean, (squares / count - mean * mean).clamp(min=0), count


def _update_running(bn: nn.BatchNorm2d, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
    """BatchNorm2d's update: exponential (or, momentum=None, cumulative) average; unbiased variance."""
    running_mean, running_var, tracked = bn.running_mean, bn.running_var, bn.num_batches_tracked
    assert running_mean is not None and running_var is not None and tracked is not None
    with torch.no_grad():
        tracked.add_(1)
        factor = 1.0 / float(tracked) if bn.momentum is None else bn.momentum
        unbiased = var * count / (count - 1).clamp(min=1)
        running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
        running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)


def batch_norm_tiles(x: torch.Tensor, bn: nn.BatchNorm2d, group: dist.ProcessGroup | None, *, sync: bool,
                     owned: tuple[slice, slice] | None = None) -> torch.Tensor:
    """Normalise ``x`` with ``bn``'s parameters, statistics from the pixels this rank owns.

    ``owned`` selects the owned pixels inside ``x`` when ``x`` also holds halo copies (fused
    groups); by default all of ``x`` is owned. In eval mode the running statistics are used.
    """
    use_batch_stats = bn.training or bn.running_mean is None
    if not use_batch_stats:
        return nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    owned_pixels = x if owned is None else x[(..., *owned)]
    mean, var, count = _moments(owned_pixels, group, sync)
    if bn.training and bn.track_running_stats and bn.running_mean is not None:
        _update_running(bn, mean.detach(), var.detach(), count.detach())
    scale = torch.rsqrt(var + bn.eps).to(x.dtype)
    shift = mean.to(x.dtype)
    y = (x - shift[None, :, None, None]) * scale[None, :, None, None]
    if bn.affine:
        y = y * bn.weight[None, :, None, None] + bn.bias[None, :, None, None]
    return y


class SpatialBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d over tiles, sharing the parameters and running buffers of the layer it replaces.

    Example::

        bn = SpatialBatchNorm2d.from_module(model.bn1, group)         # synchronised statistics
        y_tile = bn(x_tile)                                            # equals model.bn1(x) on this tile
        per_tile = SpatialBatchNorm2d.from_module(model.bn1, group, sync=False)
    """

    group: dist.ProcessGroup | None
    sync: bool

    @classmethod
    def from_module(cls, bn: nn.BatchNorm2d, group: dist.ProcessGroup | None, *,
                    sync: bool = True) -> SpatialBatchNorm2d:
        """The spatial version of ``bn``: same weight, bias, running statistics, eps and momentum."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        for attribute in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            setattr(layer, attribute, getattr(bn, attribute))
        layer.register_parameter("weight", bn.weight)
        layer.register_parameter("bias", bn.bias)
        for buffer in ("running_mean", "running_var", "num_batches_tracked"):
            layer.register_buffer(buffer, getattr(bn, buffer))
        layer.group, layer.sync = group, sync
        layer.train(bn.training)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return batch_norm_tiles(x, self, self.group, sync=self.sync)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sync={self.sync}"
