"""Gradient all-reduce for weights replicated across the tiles of an image."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def allreduce_replicated_grads(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum every trainable parameter's gradient over the tile group, in place.

    Each tile's backward pass yields the part of a weight gradient that its pixels contribute;
    the sum over tiles is the unpartitioned gradient. A parameter without a gradient on this rank
    contributes zeros (so all ranks reduce the same buffers). One all-reduce per dtype and device.

    Example::

        loss.backward()
        allreduce_replicated_grads(spatial_model, group)
        optimizer.step()
    """
    buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for parameter in module.parameters():
        if parameter.requires_grad:
            buckets.setdefault((parameter.dtype, parameter.device), []).append(parameter)
    for parameters in buckets.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for parameter in parameters:
            parameter.grad = flat[offset:offset + parameter.numel()].view_as(parameter).clone()
            offset += parameter.numel()
