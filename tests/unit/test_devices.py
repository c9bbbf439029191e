"""Unit tests for cost_models.devices: presets, lookup, JSON I/O and the lazily measured CPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from cost_models import devices
from cost_models.devices import (
    DEVICES,
    MATH_FORMATS,
    PRESETS,
    DeviceCatalog,
    DeviceSpec,
    LinkSpec,
    get_device,
    load_device,
    save_device,
)
from cost_models.errors import InvalidArgument, UnknownDevice
from cost_models.optimizer_timing import CPU_MIX, measure_gradient_sums, measure_optimizer_steps
from planner.plan import StateTier

GIB = 2**30

EXPECTED_MEM_BYTES = {
    "V100-16GB": 16 * GIB,
    "V100-32GB": 32 * GIB,
    "A100-40GB": 40 * GIB,
    "A100-80GB": 80 * GIB,
    "H100-80GB": 80 * GIB,
    "H200-141GB": 141 * GIB,
}

FIELD_NAMES = {
    "name",
    "mem_bytes",
    "fp64_tflops",
    "fp32_tflops",
    "tf32_tflops",
    "fp16_tflops",
    "bf16_tflops",
    "mem_bandwidth_gb_per_s",
    "intra_node",
    "inter_node",
    "host_link",
    "nvme",
    "matmul_efficiency",
    "memory_efficiency",
    "kernel_overhead_us",
    "host_mem_bytes",
    "nvme_bytes",
    "host_optimizer_params_per_s",
    "host_grad_sum_params_per_s",
    "collective_link",
    "optimizer_steps",
    "backend",
}


def _fake_cpu() -> DeviceSpec:
    return dataclasses.replace(PRESETS["A100-40GB"], name="cpu")


def test_presets_are_the_six_gpus_and_catalog_adds_cpu() -> None:
    assert set(PRESETS) == set(EXPECTED_MEM_BYTES)
    assert list(DEVICES) == [*PRESETS, "cpu"]
    assert len(DEVICES) == len(PRESETS) + 1
    assert "cpu" in DEVICES and "A100-80GB" in DEVICES and "TPU" not in DEVICES


@pytest.mark.parametrize("name", sorted(EXPECTED_MEM_BYTES))
def test_preset_fields_are_positive_and_named(name: str) -> None:
    spec = PRESETS[name]
    assert {f.name for f in dataclasses.fields(spec)} == FIELD_NAMES
    assert spec.name == name
    assert spec.mem_bytes == EXPECTED_MEM_BYTES[name]
    assert spec.backend == "nccl"
    for field in ("fp64_tflops", "fp32_tflops", "fp16_tflops", "mem_bandwidth_gb_per_s", "kernel_overhead_us"):
        assert getattr(spec, field) > 0, field
    assert 0 < spec.matmul_efficiency <= 1 and 0 < spec.memory_efficiency <= 1
    assert spec.host_mem_bytes >= spec.mem_bytes and spec.nvme_bytes > spec.host_mem_bytes
    for link in (spec.intra_node, spec.inter_node, spec.host_link, spec.nvme):
        assert isinstance(link, LinkSpec)
        assert link.bandwidth_gb_per_s > 0 and link.latency_us > 0
    # NVLink beats the NIC, the NIC share beats nothing: sanity of the preset ordering.
    assert spec.intra_node.bandwidth_gb_per_s > spec.inter_node.bandwidth_gb_per_s
    assert spec.peak_flops("fp16") > spec.peak_flops("fp32")


def test_datasheet_numbers_spot_check() -> None:
    v100 = PRESETS["V100-16GB"]
    assert (v100.fp32_tflops, v100.fp16_tflops, v100.mem_bandwidth_gb_per_s) == (15.7, 125.0, 900.0)
    assert v100.intra_node.bandwidth_gb_per_s == 150.0  # NVLink2 300 GB/s bidirectional
    a100 = PRESETS["A100-80GB"]
    assert (a100.tf32_tflops, a100.bf16_tflops, a100.mem_bandwidth_gb_per_s) == (156.0, 312.0, 2039.0)
    assert a100.host_link.bandwidth_gb_per_s == 31.5
    assert PRESETS["H100-80GB"].bf16_tflops == pytest.approx(989, abs=1)
    assert PRESETS["H200-141GB"].mem_bandwidth_gb_per_s == 4800.0
    assert PRESETS["H200-141GB"].inter_node.bandwidth_gb_per_s == 50.0  # NDR 400 Gb/s


def test_peak_flops_and_bandwidth_units() -> None:
    a100 = PRESETS["A100-40GB"]
    assert a100.peak_flops("bf16") == 312e12
    assert a100.peak_flops("FP32") == 19.5e12
    assert a100.mem_bandwidth_bytes_per_s() == 1555e9
    assert a100.supported_precisions() == MATH_FORMATS


def test_v100_has_no_bf16() -> None:
    v100 = PRESETS["V100-32GB"]
    with pytest.raises(InvalidArgument) as info:
        v100.peak_flops("bf16")
    message = str(info.value)
    assert "V100-32GB" in message and "fp16" in message and "fp32" in message
    assert v100.supported_precisions() == ("fp64", "fp32", "fp16")


def test_unknown_precision_lists_the_valid_ones() -> None:
    with pytest.raises(InvalidArgument, match=r"fp8.*fp64, fp32, tf32, fp16, bf16"):
        PRESETS["H100-80GB"].peak_flops("fp8")


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("V100-16GB", "V100-16GB"),
        ("v100-16gb", "V100-16GB"),
        ("A100_80GB", "A100-80GB"),
        ("a100 80gb", "A100-80GB"),
        ("h100", "H100-80GB"),
        ("H200", "H200-141GB"),
    ],
)
def test_get_device_name_variants(query: str, expected: str) -> None:
    assert get_device(query) is PRESETS[expected]


def test_get_device_passes_a_spec_through() -> None:
    spec = PRESETS["H100-80GB"]
    assert get_device(spec) is spec


def test_unknown_device_message_names_value_presets_and_json() -> None:
    with pytest.raises(UnknownDevice) as info:
        get_device("TPUv9")
    message = str(info.value)
    assert "TPUv9" in message and "A100-80GB" in message and "JSON" in message and "mem_bytes" in message


def test_ambiguous_model_name_asks_which() -> None:
    with pytest.raises(UnknownDevice, match=r"ambiguous.*V100-16GB.*V100-32GB"):
        get_device("V100")


def test_json_round_trip(tmp_path: Path) -> None:
    for spec in PRESETS.values():
        path = tmp_path / f"{spec.name}.json"
        save_device(spec, path)
        json.loads(path.read_text())  # plain JSON
        assert load_device(path) == spec
        assert get_device(str(path)) == spec
        assert DeviceSpec.from_dict(spec.to_dict()) == spec


def test_custom_device_file_without_json_suffix(tmp_path: Path) -> None:
    custom = dataclasses.replace(PRESETS["A100-40GB"], name="my-gpu", mem_bytes=24 * GIB)
    path = tmp_path / "my_gpu.device"
    save_device(custom, path)
    assert get_device(str(path)) == custom


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


def test_missing_key_is_named(tmp_path: Path) -> None:
    data = PRESETS["A100-40GB"].to_dict()
    del data["fp32_tflops"]
    path = _write(tmp_path, data)
    with pytest.raises(UnknownDevice) as info:
        load_device(path)
    assert "fp32_tflops" in str(info.value) and str(path) in str(info.value)
    assert "mem_bandwidth_gb_per_s" in str(info.value)  # lists the expected keys


def test_unknown_key_is_named(tmp_path: Path) -> None:
    data = PRESETS["A100-40GB"].to_dict()
    data["tensor_cores"] = 432
    with pytest.raises(UnknownDevice, match=r"tensor_cores"):
        load_device(_write(tmp_path, data))


def test_wrong_type_is_named(tmp_path: Path) -> None:
    data = PRESETS["A100-40GB"].to_dict()
    data["mem_bytes"] = "40GB"
    with pytest.raises(InvalidArgument, match=r"mem_bytes.*'40GB'"):
        load_device(_write(tmp_path, data))


def test_bad_link_key_is_named(tmp_path: Path) -> None:
    data = PRESETS["A100-40GB"].to_dict()
    del data["inter_node"]["latency_us"]
    with pytest.raises(UnknownDevice, match=r"inter_node.*latency_us"):
        load_device(_write(tmp_path, data))


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(UnknownDevice, match=r"nope.json"):
        get_device(str(missing))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(UnknownDevice, match=r"not valid JSON"):
        load_device(broken)
    with pytest.raises(UnknownDevice, match=r"one JSON object"):
        load_device(_write(tmp_path, [1, 2]))


def test_validation_names_field_and_value() -> None:
    base = PRESETS["A100-40GB"]
    with pytest.raises(InvalidArgument, match=r"matmul_efficiency.*1.5"):
        dataclasses.replace(base, matmul_efficiency=1.5)
    with pytest.raises(InvalidArgument, match=r"mem_bytes.*-1"):
        dataclasses.replace(base, mem_bytes=-1)
    with pytest.raises(InvalidArgument, match=r"fp32_tflops.*0"):
        dataclasses.replace(base, fp32_tflops=0.0)
    with pytest.raises(InvalidArgument, match=r"bandwidth_gb_per_s.*-3"):
        LinkSpec("x", bandwidth_gb_per_s=-3.0, latency_us=1.0)
    with pytest.raises(InvalidArgument, match=r"latency_us.*nan"):
        LinkSpec("x", bandwidth_gb_per_s=1.0, latency_us=float("nan"))


def test_int_fields_are_normalised_to_float() -> None:
    link = LinkSpec("x", bandwidth_gb_per_s=10, latency_us=5, post_us=2)
    assert isinstance(link.bandwidth_gb_per_s, float) and isinstance(link.latency_us, float)
    assert isinstance(link.post_us, float) and LinkSpec.from_dict(link.to_dict()) == link


def test_a_link_written_before_its_post_cost_reads_as_free_to_post() -> None:
    old = {"name": "x", "bandwidth_gb_per_s": 10.0, "latency_us": 5.0}
    assert LinkSpec.from_dict(old) == LinkSpec("x", 10.0, 5.0, post_us=0.0)
    with pytest.raises(InvalidArgument, match=r"post_us.*-1"):
        LinkSpec("x", bandwidth_gb_per_s=1.0, latency_us=1.0, post_us=-1.0)


def test_link_transfer_ms() -> None:
    link = LinkSpec("test", bandwidth_gb_per_s=10.0, latency_us=5.0)
    assert link.transfer_ms(0) == 0.0
    assert link.transfer_ms(10**9) == pytest.approx(100.005)
    with pytest.raises(InvalidArgument, match=r"-1"):
        link.transfer_ms(-1)
    with pytest.raises(InvalidArgument, match=r"int"):
        link.transfer_ms(1.5)  # type: ignore[arg-type]


def test_catalog_measures_cpu_lazily_once() -> None:
    calls: list[int] = []

    def measure() -> DeviceSpec:
        calls.append(1)
        return _fake_cpu()

    catalog = DeviceCatalog(measure_cpu=measure)
    assert not catalog.cpu_measured
    assert "cpu" in catalog and list(catalog)[-1] == "cpu" and len(catalog) == 7
    assert catalog["A100-80GB"] is PRESETS["A100-80GB"]
    assert calls == []
    first = catalog["cpu"]
    assert catalog["cpu"] is first and calls == [1] and catalog.cpu_measured
    with pytest.raises(KeyError):
        catalog["TPU"]


def test_importing_devices_does_not_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    # Execute a fresh copy of the module under another name; its catalog must be unmeasured.
    source = Path(devices.__file__)
    spec = importlib.util.spec_from_file_location("_devices_fresh_copy", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_devices_fresh_copy", module)
    import torch

    monkeypatch.setattr(torch, "matmul", lambda *_, **__: pytest.fail("benchmarked on import"))
    spec.loader.exec_module(module)
    assert module.DEVICES.cpu_measured is False


def test_measured_cpu_is_positive() -> None:
    cpu = DEVICES["cpu"]
    assert DEVICES.cpu_measured and DEVICES["cpu"] is cpu and get_device("CPU") is cpu
    assert cpu.name == "cpu"
    assert cpu.mem_bytes > 2**26
    assert cpu.fp32_tflops > 0 and cpu.fp64_tflops > 0
    assert cpu.fp16_tflops >= 0 and cpu.bf16_tflops >= 0 and cpu.tf32_tflops == 0
    assert cpu.mem_bandwidth_gb_per_s > 0 and cpu.kernel_overhead_us > 0
    assert cpu.matmul_efficiency == 1.0 and cpu.memory_efficiency == 1.0
    assert cpu.host_link.bandwidth_gb_per_s == cpu.mem_bandwidth_gb_per_s
    assert DeviceSpec.from_dict(json.loads(json.dumps(cpu.to_dict()))) == cpu


def test_measure_cpu_rejects_bad_threads() -> None:
    with pytest.raises(InvalidArgument, match=r"threads.*0"):
        devices.measure_cpu_device(threads=0)


def test_device_files_without_host_fields_load_with_defaults() -> None:
    data = PRESETS["V100-16GB"].to_dict()
    for key in ("host_mem_bytes", "nvme_bytes", "host_optimizer_params_per_s"):
        data.pop(key)
    spec = DeviceSpec.from_dict(data)
    assert spec.host_mem_bytes == DeviceSpec.__dataclass_fields__["host_mem_bytes"].default
    assert DeviceSpec.from_dict(PRESETS["V100-32GB"].to_dict()) == PRESETS["V100-32GB"]
    assert "host_grad_sum_params_per_s" not in data and spec.host_grad_sum_params_per_s is None


def test_the_host_sums_gradients_faster_than_it_steps_adam_over_the_same_tensors() -> None:
    """What calibration measures for a GPU's host, here on this CPU: one pass over three arrays per parameter
    against Adam's passes over seven."""
    mix = CPU_MIX[:24]
    adam = measure_optimizer_steps(torch.device("cpu"), mix, 2**20, foreach=True, names=("adam",))["adam"]
    assert measure_gradient_sums(mix, 2**20) > adam.params_per_s(mix) > 0


def test_gradients_are_summed_on_the_host_at_the_measured_rate_else_one_estimated_from_the_step() -> None:
    """Without a measured rate, a sum (two arrays read, one written) runs at 7/3 of the host's Adam rate (seven
    arrays); a calibrated rate replaces it and survives the device file; zero or negative is refused."""
    preset = PRESETS["V100-32GB"]
    assert preset.grad_sum_params_per_s() == pytest.approx(preset.host_optimizer_params_per_s * 7 / 3)
    measured = dataclasses.replace(preset, host_grad_sum_params_per_s=5e9)
    assert measured.grad_sum_params_per_s() == 5e9
    assert DeviceSpec.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured
    with pytest.raises(InvalidArgument, match="host_grad_sum_params_per_s"):
        dataclasses.replace(preset, host_grad_sum_params_per_s=0.0)


def test_the_measured_cpu_is_cached_per_machine_and_read_back(tmp_path: Path) -> None:
    """Measured once, then read from the cache: the same command plans alike every time."""
    calls: list[int] = []

    def measure() -> DeviceSpec:
        calls.append(1)
        return _fake_cpu()

    first = devices.cached_cpu_device(tmp_path, measure)
    (cached,) = (tmp_path / "devices").glob("cpu-*.json")
    assert devices.cached_cpu_device(tmp_path, measure) == first and calls == [1]
    cached.write_text("{ not json")
    assert devices.cached_cpu_device(tmp_path, measure) == first and calls == [1, 1]  # a bad file: measured again


def test_the_gloo_link_and_all_reduce_between_two_local_processes_are_measured() -> None:
    from cost_models.comm import allreduce_link

    link, collective = devices.measure_gloo_links()
    assert link.name == "gloo TCP loopback (measured)"
    assert collective.name == "gloo all-reduce on TCP loopback (measured)"
    for measured in (link, collective):
        assert 0 < measured.latency_us < 10_000 and 0.01 < measured.bandwidth_gb_per_s < 1_000
    assert 0 < link.post_us < 10_000 and collective.post_us == 0.0  # a post takes the rank's core: gloo's calls
    cpu = devices.measure_cpu_device(link=link, collective=collective)
    assert cpu.intra_node == link and cpu.inter_node.bandwidth_gb_per_s == link.bandwidth_gb_per_s
    assert cpu.collective_link == collective and type(cpu).from_dict(cpu.to_dict()) == cpu
    assert allreduce_link(cpu, [0, 1], gpus_per_node=2) == collective  # all-reduces in the node: the collective
    assert allreduce_link(dataclasses.replace(cpu, collective_link=None), [0, 1], gpus_per_node=2) == link


def test_the_cpu_device_times_each_optimizers_step_per_tensor_and_per_parameter() -> None:
    """Every optimizer the plans name is timed; Adam's step runs more ops per tensor, over more state per
    parameter, than plain SGD's; the timings survive the device file."""
    cpu = devices.measure_cpu_device(threads=1)
    steps = dict(cpu.optimizer_steps)
    assert set(steps) == {"sgd", "momentum", "adam", "adamw"}
    assert all(0 < cost.us_per_tensor < 1000 and 0 < cost.ns_per_param < 1000 for cost in steps.values())
    assert steps["sgd"].us_per_tensor < steps["adam"].us_per_tensor
    assert steps["sgd"].ns_per_param < steps["adam"].ns_per_param
    assert cpu.optimizer_step("adam") == steps["adam"] and type(cpu).from_dict(cpu.to_dict()) == cpu
    assert dataclasses.replace(cpu, optimizer_steps=()).optimizer_step("adam") is None
    # the host tier is this CPU: its Adam updates the 40 mixed tensors' 4.2 M parameters at the same rate
    seconds = (40 * steps["adam"].us_per_tensor * 1e-6 + sum(CPU_MIX) * steps["adam"].ns_per_param * 1e-9)
    assert len(CPU_MIX) == 40 and cpu.host_optimizer_params_per_s == pytest.approx(sum(CPU_MIX) / seconds)
    assert cpu.host_grad_sum_params_per_s is None  # its sums share the backward's core: estimated (see there)


def test_on_the_cpu_device_the_host_tier_buys_no_speed() -> None:
    """The host is the CPU itself: moving the optimizer there steps at the same rate and adds the copies,
    so a model that fits keeps it on the device (it was chosen for speed while the host rate was a
    400 M parameters/s default, several times the measured CPU step)."""
    from examples.models.gpt import gpt
    from planner import plan

    model = gpt(vocab=8192, hidden=256, layers=2, heads=4, seq_len=32, dropout=0.0, device="meta")
    made = plan(model, 1, "8GB", batch_size=4, example_inputs=torch.zeros((1, 32), dtype=torch.int64),
                device="cpu", optimizer="adam", precision="fp32", profile=False)
    assert made.stages[0].offload.optimizer_state is StateTier.GPU


def test_a_gpu_rank_gets_its_share_of_the_cores_and_at_least_one() -> None:
    from cost_models.cpu_device import rank_threads, usable_cores

    cores = usable_cores()
    assert rank_threads(1) == cores
    assert rank_threads(2) == max(1, cores // 2)
    assert rank_threads(cores * 4) == 1 and rank_threads(0) == cores
