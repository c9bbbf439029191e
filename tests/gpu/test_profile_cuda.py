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
    fc = table["fc"]  # its backward: its input's, weight's and bias's gradients (the allocator's peak)
    weight = model.fc.weight
    assert fc.measured_bwd_bytes is not None
    assert fc.measured_bwd_bytes >= 4 * (8 * weight.shape[1] + weight.numel() + weight.shape[0])


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


def test_a_plan_for_this_gpu_is_costed_from_times_measured_on_it(tmp_path, monkeypatch) -> None:
    """plan(profile=True) with the local GPU's preset measures each node there (in the plan's 16-bit dtype)."""
    from cost_models.devices import get_device
    from cost_models.graph.tracing import trace
    from cost_models.profiling import _preset_for_local_gpu, in_compute_dtype, local_gpu, measured_table
    from examples.models.gpt import gpt
    from planner import plan

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    preset = _preset_for_local_gpu(torch.device("cuda"))
    assert local_gpu(preset) == torch.device("cuda", 0)
    model = gpt(hidden=256, layers=2, heads=4, seq_len=128, vocab=1024, dropout=0.0, device="cpu")
    tokens = torch.zeros((1, 128), dtype=torch.int64)
    made = plan(model, 1, "16GB", batch_size=16, micro_batch_sizes=(8,), example_inputs=tokens,
                device=preset.name, precision="bf16", profile=True)
    copy = in_compute_dtype(model, torch.device("cuda", 0), torch.bfloat16)
    table = measured_table(copy, trace(model, (tokens,)), (tokens,), 8, optimizer="adam", precision="bf16",
                           device=get_device(preset.name))
    by_name = {cost.name: cost for cost in table.costs}  # from the cache plan() filled
    assert all((row.fwd_ms, row.bwd_ms) == (by_name[row.name].fwd_ms, by_name[row.name].bwd_ms)
               for row in made.layers)
    assert sum(row.fwd_ms + row.bwd_ms for row in made.layers) > 0
