"""ZB-H1's split backward (runtime/split_backward.py) against one whole backward, in float64: I then W give
the same input and weight gradients, with a weight used twice in the stage (torch's W, one backward per
group freeing what it crossed, failed there) and with a region the runtime checkpoints (recomputed in I and
again in W, with the one recompute context its forward made), whose buffers come out as one forward left
them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.recompute import Checkpointed
from runtime.split_backward import backward_input, backward_weight, covers_every_weight


class Region(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.first = nn.Linear(width, width, dtype=torch.float64)
        self.second = nn.Linear(width, width, dtype=torch.float64)
        self.norm = nn.BatchNorm1d(width, dtype=torch.float64)  # its running statistics: buffers restored

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.norm(self.first(x))))


class Stage(nn.Module):
    """A later stage: a region (checkpointed as the runtime does), then the region's first layer again (a
    weight used twice), and a head."""

    def __init__(self, width: int = 8, recompute: bool = False) -> None:
        super().__init__()
        self.region = Region(width)
        self.run = Checkpointed(self.region) if recompute else self.region
        self.head = nn.Linear(width, width, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.run(x)
        hidden = hidden + self.region.first(hidden)
        return self.head(hidden).square().mean()


@pytest.mark.parametrize("recompute", [False, True])
def test_input_then_weight_gradients_equal_one_backward(recompute: bool) -> None:
    torch.manual_seed(0)
    received = torch.randn(4, 8, dtype=torch.float64)
    results = []
    for split in (False, True):
        torch.manual_seed(1)
        stage = Stage(recompute=recompute)
        x = received.clone().requires_grad_()
        loss = stage(x)
        weights = list(stage.parameters())
        if split:
            assert covers_every_weight([loss], [x], weights)
            groups = backward_input([loss], [None], [x], weights)
            backward_weight(weights, groups)
        else:
            loss.backward()
        results.append([x.grad, *(weight.grad for weight in weights), *stage.buffers()])
    whole, split = results
    for expected, got in zip(whole, split):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def test_weight_gradients_accumulate_over_micro_batches() -> None:
    """A second micro-batch's W adds into the gradients the first wrote."""
    torch.manual_seed(1)
    stage = Stage()
    inputs = [torch.randn(4, 8, dtype=torch.float64) for _ in range(2)]
    for x in inputs:
        stage(x.requires_grad_()).backward()
    expected = [weight.grad.clone() for weight in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    weights = list(stage.parameters())
    pending = []
    for x in inputs:
        x.grad = None
        pending.append(backward_input([stage(x)], [None], [x], weights))
    for groups in pending:
        backward_weight(weights, groups)
    for want, weight in zip(expected, weights):
        torch.testing.assert_close(weight.grad, want, rtol=1e-12, atol=0)
