"""On a CUDA device: the profiler's timings and memory, and predicted saved bytes vs the allocator."""

from __future__ import annotations

import pytest
import torch

from cost_models import estimate, profile
from cost_models.graph.tracing import trace_module
from examples.models.resnet import resnet50

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_profile_measures_time_and_peak_memory() -> None:
    model = resnet50(width=16, device="cuda")
    table = profile(model, (torch.randn(8, 3, 128, 128, device="cuda"),), "cuda", repeats=3)
    conv = table["conv1"]
    assert conv.fwd_ms > 0 and conv.bwd_ms > 0
    assert conv.measured_fwd_peak_bytes is not None
    assert conv.measured_fwd_peak_bytes >= conv.output_bytes


def test_predicted_saved_bytes_match_cuda_allocator() -> None:
    model = resnet50(width=16, device="cuda")
    x = torch.randn(8, 3, 128, 128, device="cuda")
    graph, _ = trace_module(model, (x,))
    predicted = estimate(graph, "H100-80GB").total("saved_activation_bytes")
    input_bytes = x.numel() * x.element_size()  # allocated before the forward, so not in the delta
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(x).sum()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    assert loss.requires_grad
    assert kept == pytest.approx(predicted - input_bytes, rel=0.05)
