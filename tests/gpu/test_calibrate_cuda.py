"""On a CUDA device: `tessera calibrate --device cuda` measures the GPU into a device file plan() accepts."""

from __future__ import annotations

import pytest
import torch

from cost_models.calibration import calibrate
from cost_models.device_spec import CALIBRATED
from cost_models.devices import get_device, save_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_calibrated_gpu_figures_are_achieved_rates_below_the_datasheet(tmp_path) -> None:
    measured = calibrate("cuda")
    spec = measured.device
    base = get_device(spec.name.removesuffix(CALIBRATED))
    for precision in ("fp32", "fp16", "bf16"):
        rate, peak = getattr(spec, f"{precision}_tflops"), getattr(base, f"{precision}_tflops")
        assert 0 < rate <= 1.1 * peak, (precision, rate, peak)
    assert 0 < spec.mem_bandwidth_gb_per_s <= 1.1 * base.mem_bandwidth_gb_per_s
    assert 0 < spec.host_link.bandwidth_gb_per_s and 0 < spec.kernel_overhead_us < 100
    assert spec.intra_node == base.intra_node  # one GPU cannot measure its links
    # the host's sums of gradients sent down pass once over three arrays, its Adam step several times over seven
    assert spec.host_grad_sum_params_per_s is not None
    assert spec.host_grad_sum_params_per_s > spec.host_optimizer_params_per_s > 0
    path = tmp_path / "gpu.json"
    save_device(spec, path)
    assert get_device(path) == spec
