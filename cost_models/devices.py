"""Device and link specifications: datasheet-cited GPU presets, a measured CPU device, and JSON I/O."""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from planner.errors import InvalidArgument, UnknownDevice

__all__ = [
    "A100_40GB",
    "A100_80GB",
    "DEVICES",
    "H100_80GB",
    "H200_141GB",
    "IB_EDR_HALF",
    "IB_HDR",
    "IB_NDR",
    "NVLINK2",
    "NVLINK3",
    "NVLINK4",
    "NVME_GEN3_X4",
    "NVME_GEN4_X4",
    "PCIE_GEN3_X16",
    "PCIE_GEN4_X16",
    "PCIE_GEN5_X16",
    "PRECISIONS",
    "PRESETS",
    "V100_16GB",
    "V100_32GB",
    "DeviceCatalog",
    "DeviceSpec",
    "LinkSpec",
    "get_device",
    "load_device",
    "measure_cpu_device",
    "save_device",
]

PRECISIONS: tuple[str, ...] = ("fp64", "fp32", "tf32", "fp16", "bf16")
"""Precisions accepted by `DeviceSpec.peak_flops`, in the order of the `*_tflops` fields."""

_GIB = 2**30
_BYTES_PER_GB = 1e9  # bandwidths use decimal GB (1e9 bytes), as datasheets and PCI-SIG do
_CPU_NAME = "cpu"


def _check_number(owner: str, field: str, value: object, *, allow_zero: bool) -> float:
    """Return `value` as a finite float, or raise InvalidArgument naming `owner.field` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(
            f"{owner}: field {field!r} must be a number, got {value!r} ({type(value).__name__}); pass an int or float"
        )
    number = float(value)
    bound_ok = number >= 0.0 if allow_zero else number > 0.0
    if not math.isfinite(number) or not bound_ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgument(f"{owner}: field {field!r} must be finite and {bound}, got {value!r}")
    return number


def _check_nbytes(nbytes: object) -> int:
    """Return `nbytes` as an int >= 0, or raise InvalidArgument naming the value."""
    if isinstance(nbytes, bool):
        raise InvalidArgument(f"nbytes must be an int number of bytes, got {nbytes!r}")
    try:
        count = operator.index(nbytes)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(
            f"nbytes must be an int number of bytes, got {nbytes!r} ({type(nbytes).__name__}); "
            f"round it with int() first"
        ) from None
    if count < 0:
        raise InvalidArgument(f"nbytes must be >= 0, got {count}; a transfer cannot move negative bytes")
    return count


@dataclass(frozen=True)
class LinkSpec:
    """One data path of a GPU, modelled alpha-beta: a fixed latency plus bytes over a bandwidth.

    `bandwidth_gb_per_s` is per direction and per GPU, with GB = 1e9 bytes.
    """

    name: str
    bandwidth_gb_per_s: float
    latency_us: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument(f"LinkSpec: field 'name' must be a non-empty string, got {self.name!r}")
        owner = f"LinkSpec {self.name!r}"
        bandwidth = _check_number(owner, "bandwidth_gb_per_s", self.bandwidth_gb_per_s, allow_zero=False)
        latency = _check_number(owner, "latency_us", self.latency_us, allow_zero=True)
        object.__setattr__(self, "bandwidth_gb_per_s", bandwidth)
        object.__setattr__(self, "latency_us", latency)

    def bandwidth_bytes_per_s(self) -> float:
        """Per-direction bandwidth in bytes per second."""
        return self.bandwidth_gb_per_s * _BYTES_PER_GB

    def transfer_ms(self, nbytes: int) -> float:
        """Milliseconds to move `nbytes` one way: latency + nbytes / bandwidth; 0.0 for 0 bytes."""
        count = _check_nbytes(nbytes)
        if count == 0:
            return 0.0
        return self.latency_us * 1e-3 + count / self.bandwidth_bytes_per_s() * 1e3

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form: {"name", "bandwidth_gb_per_s", "latency_us"}."""
        return {"name": self.name, "bandwidth_gb_per_s": self.bandwidth_gb_per_s, "latency_us": self.latency_us}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "link") -> LinkSpec:
        """Inverse of `to_dict`; `where` names the object in error messages (e.g. "intra_node")."""
        _check_keys(data, _LINK_KEYS, where)
        return cls(
            name=_expect_str(data["name"], f"{where}.name"),
            bandwidth_gb_per_s=_expect_float(data["bandwidth_gb_per_s"], f"{where}.bandwidth_gb_per_s"),
            latency_us=_expect_float(data["latency_us"], f"{where}.latency_us"),
        )


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or the host CPU) as the cost models see it.

    `mem_bytes` is the nominal memory capacity in bytes. For GPU presets it is the datasheet
    capacity read as GiB (HBM is sized in powers of two: "16 GB" = 16 * 2**30 bytes); the CUDA
    context and driver reservations are NOT subtracted here.

    Each `*_tflops` is the dense (no structured sparsity) peak for matmul in that precision, in
    TFLOP/s: on tensor cores where the device has them for that precision, else on the regular
    FP units; 0.0 means the device cannot run that precision (V100 has no tf32/bf16 tensor cores).

    `matmul_efficiency`, `memory_efficiency` and `kernel_overhead_us` are calibration values, not
    datasheet figures: the achieved fraction of peak FLOP/s for dense matmul/conv, the achieved
    fraction of peak memory bandwidth for elementwise kernels, and the fixed cost per launched op.
    """

    name: str
    mem_bytes: int
    fp64_tflops: float
    fp32_tflops: float
    tf32_tflops: float
    fp16_tflops: float
    bf16_tflops: float
    mem_bandwidth_gb_per_s: float
    intra_node: LinkSpec
    inter_node: LinkSpec
    host_link: LinkSpec
    nvme: LinkSpec
    matmul_efficiency: float
    memory_efficiency: float
    kernel_overhead_us: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument(f"DeviceSpec: field 'name' must be a non-empty string, got {self.name!r}")
        owner = f"DeviceSpec {self.name!r}"
        if isinstance(self.mem_bytes, bool) or not isinstance(self.mem_bytes, int) or self.mem_bytes <= 0:
            raise InvalidArgument(
                f"{owner}: field 'mem_bytes' must be a positive int number of bytes, got {self.mem_bytes!r}"
            )
        for field in ("fp64_tflops", "tf32_tflops", "fp16_tflops", "bf16_tflops"):
            object.__setattr__(self, field, _check_number(owner, field, getattr(self, field), allow_zero=True))
        for field in ("fp32_tflops", "mem_bandwidth_gb_per_s"):
            object.__setattr__(self, field, _check_number(owner, field, getattr(self, field), allow_zero=False))
        for field in ("matmul_efficiency", "memory_efficiency"):
            value = _check_number(owner, field, getattr(self, field), allow_zero=False)
            if value > 1.0:
                raise InvalidArgument(
                    f"{owner}: field {field!r} is a fraction of peak and must be in (0, 1], got {value!r}"
                )
            object.__setattr__(self, field, value)
        overhead = _check_number(owner, "kernel_overhead_us", self.kernel_overhead_us, allow_zero=True)
        object.__setattr__(self, "kernel_overhead_us", overhead)
        for field in _LINK_FIELDS:
            link = getattr(self, field)
            if not isinstance(link, LinkSpec):
                raise InvalidArgument(
                    f"{owner}: field {field!r} must be a LinkSpec, got {link!r} ({type(link).__name__})"
                )

    def supported_precisions(self) -> tuple[str, ...]:
        """The precisions with a non-zero peak on this device, in `PRECISIONS` order."""
        return tuple(p for p in PRECISIONS if getattr(self, f"{p}_tflops") > 0.0)

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s in `precision` (one of PRECISIONS)."""
        key = precision.lower() if isinstance(precision, str) else precision
        if key not in PRECISIONS:
            raise InvalidArgument(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
        tflops: float = getattr(self, f"{key}_tflops")
        if tflops <= 0.0:
            raise InvalidArgument(
                f"device {self.name!r} has no {key} support ({key}_tflops = 0); "
                f"it supports {', '.join(self.supported_precisions())}"
            )
        return tflops * 1e12

    def mem_bandwidth_bytes_per_s(self) -> float:
        """Peak memory bandwidth in bytes per second."""
        return self.mem_bandwidth_gb_per_s * _BYTES_PER_GB

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (links as nested objects); `from_dict` inverts it exactly."""
        data: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            data[field.name] = value.to_dict() if isinstance(value, LinkSpec) else value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSpec:
        """Build a DeviceSpec from `to_dict` output; every key is required and no other key is allowed."""
        _check_keys(data, _DEVICE_KEYS, "device")
        kwargs: dict[str, Any] = {}
        for key in _DEVICE_KEYS:
            value = data[key]
            if key == "name":
                kwargs[key] = _expect_str(value, key)
            elif key == "mem_bytes":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidArgument(
                        f"key 'mem_bytes' must be an int number of bytes, got {value!r} ({type(value).__name__})"
                    )
                kwargs[key] = value
            elif key in _LINK_FIELDS:
                if not isinstance(value, Mapping):
                    raise InvalidArgument(
                        f"key {key!r} must be an object with keys {', '.join(_LINK_KEYS)}, "
                        f"got {value!r} ({type(value).__name__})"
                    )
                kwargs[key] = LinkSpec.from_dict(value, where=key)
            else:
                kwargs[key] = _expect_float(value, key)
        return cls(**kwargs)


_LINK_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LinkSpec))
_DEVICE_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DeviceSpec))
_LINK_FIELDS: tuple[str, ...] = ("intra_node", "inter_node", "host_link", "nvme")


def _check_keys(data: Mapping[str, Any], expected: tuple[str, ...], where: str) -> None:
    if not isinstance(data, Mapping):
        raise InvalidArgument(
            f"{where} must be a JSON object with keys {', '.join(expected)}, got {type(data).__name__}"
        )
    missing = [k for k in expected if k not in data]
    unknown = sorted(str(k) for k in data if k not in expected)
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing key(s) {', '.join(repr(k) for k in missing)}")
        if unknown:
            parts.append(f"unknown key(s) {', '.join(repr(k) for k in unknown)}")
        raise InvalidArgument(f"{where}: {'; '.join(parts)}; expected exactly the keys {', '.join(expected)}")


def _expect_str(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"key {key!r} must be a string, got {value!r} ({type(value).__name__})")
    return value


def _expect_float(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"key {key!r} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


# --------------------------------------------------------------------------------------------
# Links. Bandwidths are per direction per GPU in GB/s (1e9 bytes). Latencies are typical measured
# small-message figures, not datasheet values: recalibrate them on the real system.
# --------------------------------------------------------------------------------------------

NVLINK2 = LinkSpec(
    name="NVLink2",
    # NVIDIA Tesla V100 datasheet: NVLink 300 GB/s total bidirectional (6 links x 25 GB/s each way)
    # -> 150 GB/s per direction per GPU.
    bandwidth_gb_per_s=150.0,
    # Typical measured GPU-to-GPU small-message latency over NVLink is a few microseconds
    # (order reported by nccl-tests / OSU micro-benchmarks on DGX systems); calibration default.
    latency_us=3.0,
)
NVLINK3 = LinkSpec(
    name="NVLink3",
    # NVIDIA A100 datasheet: NVLink 600 GB/s total bidirectional (12 links) -> 300 GB/s per direction.
    bandwidth_gb_per_s=300.0,
    # Typical measured NVLink small-message latency, a few us (nccl-tests / OSU micro-benchmarks).
    latency_us=3.0,
)
NVLINK4 = LinkSpec(
    name="NVLink4",
    # NVIDIA H100 / H200 datasheets: NVLink 900 GB/s total bidirectional (18 links) -> 450 GB/s per direction.
    bandwidth_gb_per_s=450.0,
    # Typical measured NVLink small-message latency, a few us (nccl-tests / OSU micro-benchmarks).
    latency_us=3.0,
)

PCIE_GEN3_X16 = LinkSpec(
    name="PCIe gen3 x16",
    # PCI-SIG PCIe 3.0 spec: 8 GT/s per lane, 128b/130b encoding -> 16 lanes ~ 15.75 GB/s per direction
    # (V100 datasheet: "PCIe 32 GB/s" total bidirectional).
    bandwidth_gb_per_s=15.75,
    # Typical measured host<->device copy latency (cudaMemcpy of a few bytes) is ~10 us; calibration default.
    latency_us=10.0,
)
PCIE_GEN4_X16 = LinkSpec(
    name="PCIe gen4 x16",
    # PCI-SIG PCIe 4.0 spec: 16 GT/s per lane, 128b/130b -> x16 ~ 31.5 GB/s per direction
    # (A100 datasheet: "PCIe Gen4 64 GB/s" total bidirectional).
    bandwidth_gb_per_s=31.5,
    # Typical measured host<->device copy latency ~10 us; calibration default.
    latency_us=10.0,
)
PCIE_GEN5_X16 = LinkSpec(
    name="PCIe gen5 x16",
    # PCI-SIG PCIe 5.0 spec: 32 GT/s per lane, 128b/130b -> x16 ~ 63 GB/s per direction
    # (H100 / H200 datasheets: "PCIe Gen5 128 GB/s" total bidirectional).
    bandwidth_gb_per_s=63.0,
    # Typical measured host<->device copy latency ~10 us; calibration default.
    latency_us=10.0,
)

IB_EDR_HALF = LinkSpec(
    name="InfiniBand EDR (1 NIC per 2 GPUs)",
    # InfiniBand EDR = 100 Gb/s = 12.5 GB/s per port per direction. NVIDIA DGX-1 (V100) system
    # description: 4x EDR IB for 8 GPUs; DGX-2: 8x EDR IB for 16 GPUs -> one NIC per two GPUs,
    # so a GPU's share is 6.25 GB/s when all GPUs of a node talk across nodes at once.
    bandwidth_gb_per_s=6.25,
    # Typical measured IB latency: ~1-2 us NIC-to-NIC (OSU osu_latency) plus GPU/NCCL software
    # overhead; calibration default.
    latency_us=5.0,
)
IB_HDR = LinkSpec(
    name="InfiniBand HDR",
    # InfiniBand HDR = 200 Gb/s = 25 GB/s per direction. NVIDIA DGX A100 system description:
    # 8x single-port ConnectX-6 HDR 200 Gb/s compute NICs for 8 GPUs -> one NIC per GPU.
    bandwidth_gb_per_s=25.0,
    # Typical measured IB latency ~1-2 us (OSU osu_latency) plus software; calibration default.
    latency_us=5.0,
)
IB_NDR = LinkSpec(
    name="InfiniBand NDR",
    # InfiniBand NDR = 400 Gb/s = 50 GB/s per direction. NVIDIA DGX H100 / DGX H200 system
    # descriptions: 8x ConnectX-7 400 Gb/s compute NICs for 8 GPUs -> one NIC per GPU.
    bandwidth_gb_per_s=50.0,
    # Typical measured IB latency ~1-2 us (OSU osu_latency) plus software; calibration default.
    latency_us=5.0,
)

NVME_GEN3_X4 = LinkSpec(
    name="NVMe PCIe gen3 x4",
    # PCIe gen3 x4 NVMe drive class, e.g. Samsung 970 PRO spec sheet: 3,500 MB/s sequential read
    # (writes are slower). Assumes one drive per GPU; where GPUs share drives, lower this.
    bandwidth_gb_per_s=3.5,
    # Typical measured NAND NVMe read latency is tens to ~100 us; calibration default.
    latency_us=100.0,
)
NVME_GEN4_X4 = LinkSpec(
    name="NVMe PCIe gen4 x4",
    # PCIe gen4 x4 NVMe drive class, e.g. Samsung 980 PRO spec sheet: 7,000 MB/s sequential read
    # (writes are slower). DGX H100 has 8 U.2 NVMe drives for 8 GPUs -> one drive per GPU.
    bandwidth_gb_per_s=7.0,
    # Typical measured NAND NVMe read latency is tens to ~100 us; calibration default.
    latency_us=100.0,
)

# Calibration defaults shared by every GPU preset. These are NOT datasheet numbers: they are
# typical achieved fractions; recalibrate with cost_models.profile on the real device.
_MATMUL_EFFICIENCY = 0.6  # typical achieved fraction of peak FLOP/s for dense matmul/conv in real models
_MEMORY_EFFICIENCY = 0.8  # typical achieved fraction of peak HBM bandwidth for elementwise kernels
_KERNEL_OVERHEAD_US = 5.0  # typical fixed launch + scheduling cost per op (a few us)

# --------------------------------------------------------------------------------------------
# GPU presets (SXM form factor). mem_bytes = datasheet capacity read as GiB.
# --------------------------------------------------------------------------------------------

V100_16GB = DeviceSpec(
    name="V100-16GB",
    mem_bytes=16 * _GIB,  # NVIDIA Tesla V100 datasheet (2017): 16 GB HBM2
    fp64_tflops=7.8,  # V100 datasheet, SXM2: 7.8 TFLOPS double precision (no FP64 tensor cores)
    fp32_tflops=15.7,  # V100 datasheet, SXM2: 15.7 TFLOPS single precision
    tf32_tflops=0.0,  # V100 (Volta) has no TF32 tensor cores (TF32 introduced with A100/Ampere)
    fp16_tflops=125.0,  # V100 datasheet, SXM2: 125 TFLOPS tensor performance (FP16 inputs)
    bf16_tflops=0.0,  # V100 (Volta) has no BF16 tensor cores (BF16 introduced with A100/Ampere)
    mem_bandwidth_gb_per_s=900.0,  # V100 datasheet: 900 GB/s HBM2
    intra_node=NVLINK2,  # V100 datasheet: NVLink 300 GB/s (see NVLINK2)
    inter_node=IB_EDR_HALF,  # DGX-1 / DGX-2 system descriptions: EDR IB, one NIC per 2 GPUs
    host_link=PCIE_GEN3_X16,  # V100 datasheet: PCIe 32 GB/s (gen3 x16)
    nvme=NVME_GEN3_X4,  # gen3-era NVMe drive class (see NVME_GEN3_X4)
    matmul_efficiency=_MATMUL_EFFICIENCY,  # calibration default, not a datasheet figure
    memory_efficiency=_MEMORY_EFFICIENCY,  # calibration default, not a datasheet figure
    kernel_overhead_us=_KERNEL_OVERHEAD_US,  # calibration default, not a datasheet figure
)

V100_32GB = DeviceSpec(
    name="V100-32GB",
    mem_bytes=32 * _GIB,  # NVIDIA Tesla V100 datasheet: 32 GB HBM2 variant
    fp64_tflops=7.8,  # V100 datasheet, SXM2: 7.8 TFLOPS double precision
    fp32_tflops=15.7,  # V100 datasheet, SXM2: 15.7 TFLOPS single precision
    tf32_tflops=0.0,  # Volta has no TF32 tensor cores
    fp16_tflops=125.0,  # V100 datasheet, SXM2: 125 TFLOPS tensor performance (FP16 inputs)
    bf16_tflops=0.0,  # Volta has no BF16 tensor cores
    mem_bandwidth_gb_per_s=900.0,  # V100 datasheet: 900 GB/s HBM2 (same for 16 and 32 GB)
    intra_node=NVLINK2,  # V100 datasheet: NVLink 300 GB/s (see NVLINK2)
    inter_node=IB_EDR_HALF,  # DGX-2 system description: 8x EDR IB for 16 GPUs
    host_link=PCIE_GEN3_X16,  # V100 datasheet: PCIe 32 GB/s (gen3 x16)
    nvme=NVME_GEN3_X4,  # gen3-era NVMe drive class (see NVME_GEN3_X4)
    matmul_efficiency=_MATMUL_EFFICIENCY,  # calibration default, not a datasheet figure
    memory_efficiency=_MEMORY_EFFICIENCY,  # calibration default, not a datasheet figure
    kernel_overhead_us=_KERNEL_OVERHEAD_US,  # calibration default, not a datasheet figure
)

A100_40GB = DeviceSpec(
    name="A100-40GB",
    mem_bytes=40 * _GIB,  # NVIDIA A100 datasheet: 40 GB HBM2
    fp64_tflops=19.5,  # A100 datasheet, SXM4: 19.5 TFLOPS FP64 Tensor Core (9.7 without tensor cores)
    fp32_tflops=19.5,  # A100 datasheet, SXM4: 19.5 TFLOPS FP32
    tf32_tflops=156.0,  # A100 datasheet, SXM4: 156 TFLOPS TF32 Tensor Core dense (312 with sparsity)
    fp16_tflops=312.0,  # A100 datasheet, SXM4: 312 TFLOPS FP16 Tensor Core dense (624 with sparsity)
    bf16_tflops=312.0,  # A100 datasheet, SXM4: 312 TFLOPS BF16 Tensor Core dense (624 with sparsity)
    mem_bandwidth_gb_per_s=1555.0,  # A100 datasheet, 40 GB SXM4: 1,555 GB/s HBM2
    intra_node=NVLINK3,  # A100 datasheet: NVLink 600 GB/s (see NVLINK3)
    inter_node=IB_HDR,  # DGX A100 system description: 8x HDR 200 Gb/s, one per GPU
    host_link=PCIE_GEN4_X16,  # A100 datasheet: PCIe Gen4 64 GB/s
    nvme=NVME_GEN4_X4,  # gen4-era NVMe drive class (see NVME_GEN4_X4)
    matmul_efficiency=_MATMUL_EFFICIENCY,  # calibration default, not a datasheet figure
    memory_efficiency=_MEMORY_EFFICIENCY,  # calibration default, not a datasheet figure
    kernel_overhead_us=_KERNEL_OVERHEAD_US,  # calibration default, not a datasheet figure
)

A100_80GB = DeviceSpec(
    name="A100-80GB",
    mem_bytes=80 * _GIB,  # NVIDIA A100 datasheet: 80 GB HBM2e
    fp64_tflops=19.5,  # A100 datasheet, SXM4: 19.5 TFLOPS FP64 Tensor Core
    fp32_tflops=19.5,  # A100 datasheet, SXM4: 19.5 TFLOPS FP32
    tf32_tflops=156.0,  # A100 datasheet, SXM4: 156 TFLOPS TF32 Tensor Core dense
    fp16_tflops=312.0,  # A100 datasheet, SXM4: 312 TFLOPS FP16 Tensor Core dense
    bf16_tflops=312.0,  # A100 datasheet, SXM4: 312 TFLOPS BF16 Tensor Core dense
    mem_bandwidth_gb_per_s=2039.0,  # A100 datasheet, 80 GB SXM4: 2,039 GB/s HBM2e
    intra_node=NVLINK3,  # A100 datasheet: NVLink 600 GB/s (see NVLINK3)
    inter_node=IB_HDR,  # DGX A100 system description: 8x HDR 200 Gb/s, one per GPU
    host_link=PCIE_GEN4_X16,  # A100 datasheet: PCIe Gen4 64 GB/s
    nvme=NVME_GEN4_X4,  # gen4-era NVMe drive class (see NVME_GEN4_X4)
    matmul_efficiency=_MATMUL_EFFICIENCY,  # calibration default, not a datasheet figure
    memory_efficiency=_MEMORY_EFFICIENCY,  # calibration default, not a datasheet figure
    kernel_overhead_us=_KERNEL_OVERHEAD_US,  # calibration default, not a datasheet figure
)

H100_80GB = DeviceSpec(
    name="H100-80GB",
    mem_bytes=80 * _GIB,  # NVIDIA H100 datasheet, SXM5: 80 GB HBM3
    fp64_tflops=66.9,  # NVIDIA H100 architecture whitepaper (2022), SXM5: 66.9 TFLOPS FP64 Tensor Core
    fp32_tflops=66.9,  # H100 whitepaper, SXM5: 66.9 TFLOPS FP32 (datasheet rounds to 67)
    tf32_tflops=494.7,  # H100 whitepaper, SXM5: 494.7 TFLOPS TF32 dense (datasheet: 989 with sparsity)
    fp16_tflops=989.4,  # H100 whitepaper, SXM5: 989.4 TFLOPS FP16 dense (datasheet: 1,979 with sparsity)
    bf16_tflops=989.4,  # H100 whitepaper, SXM5: 989.4 TFLOPS BF16 dense (datasheet: 1,979 with sparsity)
    mem_bandwidth_gb_per_s=3350.0,  # H100 datasheet, SXM5: 3.35 TB/s HBM3
    intra_node=NVLINK4,  # H100 datasheet: NVLink 900 GB/s (see NVLINK4)
    inter_node=IB_NDR,  # DGX H100 system description: 8x ConnectX-7 400 Gb/s, one per GPU
    host_link=PCIE_GEN5_X16,  # H100 datasheet: PCIe Gen5 128 GB/s
    nvme=NVME_GEN4_X4,  # DGX H100: 8x U.2 NVMe, gen4 drive class (see NVME_GEN4_X4)
    matmul_efficiency=_MATMUL_EFFICIENCY,  # calibration default, not a datasheet figure
    memory_efficiency=_MEMORY_EFFICIENCY,  # calibration default, not a datasheet figure
    kernel_overhead_us=_KERNEL_OVERHEAD_US,  # calibration default, not a datasheet figure
)

H200_141GB = DeviceSpec(
    name="H200-141GB",
    mem_bytes=141 * _GIB,  # NVIDIA H200 product brief / datasheet: 141 GB HBM3e
    fp64_tflops=66.9,  # H200 datasheet, SXM: 67 TFLOPS FP64 Tensor Core (same GH100 compute as H100 SXM5)
    fp32_tflops=66.9,  # H200 datasheet, SXM: 67 TFLOPS FP32 (same as H100 SXM5, whitepaper 66.9)
    tf32_tflops=494.7,  # H200 datasheet, SXM: 989 TFLOPS TF32 with sparsity -> 494.7 dense as H100 SXM5
    fp16_tflops=989.4,  # H200 datasheet, SXM: 1,979 TFLOPS FP16 with sparsity -> 989.4 dense as H100 SXM5
    bf16_tflops=989.4,  # H200 datasheet, SXM: 1,979 TFLOPS BF16 with sparsity -> 989.4 dense as H100 SXM5
    mem_bandwidth_gb_per_s=4800.0,  # H200 product brief: 4.8 TB/s HBM3e
    intra_node=NVLINK4,  # H200 datasheet: NVLink 900 GB/s (see NVLINK4)
    inter_node=IB_NDR,  # DGX H200 system description: 8x ConnectX-7 400 Gb/s, one per GPU
    host_link=PCIE_GEN5_X16,  # H200 datasheet: PCIe Gen5 128 GB/s
    nvme=NVME_GEN4_X4,  # DGX H200: 8x U.2 NVMe, gen4 drive class (see NVME_GEN4_X4)
    matmul_efficiency=_MATMUL_EFFICIENCY,  # calibration default, not a datasheet figure
    memory_efficiency=_MEMORY_EFFICIENCY,  # calibration default, not a datasheet figure
    kernel_overhead_us=_KERNEL_OVERHEAD_US,  # calibration default, not a datasheet figure
)

PRESETS: Mapping[str, DeviceSpec] = MappingProxyType(
    {spec.name: spec for spec in (V100_16GB, V100_32GB, A100_40GB, A100_80GB, H100_80GB, H200_141GB)}
)
"""Read-only mapping of the GPU presets by canonical name (e.g. "A100-80GB")."""


# --------------------------------------------------------------------------------------------
# Measured CPU device.
# --------------------------------------------------------------------------------------------

_MATMUL_BUDGET_S = 0.12  # wall-clock budget per precision; four precisions stay well under 1 s
_MATMUL_MAX_SIZE = 512
_MATMUL_MIN_SIZE = 64
_COPY_MAX_BYTES = 128 * 2**20  # large enough to spill most last-level caches
_REPEATS = 3


def _median_seconds(run: Callable[[], object], *, repeats: int, budget_s: float) -> float:
    """Median wall time of `run` after one warm-up, stopping early once `budget_s` is spent."""
    run()  # warm-up: first-call allocation, page faults, kernel selection
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < repeats:
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return max(statistics.median(samples), 1e-9)


def _matmul_tflops(dtype: Any) -> float:
    """Measured CPU matmul TFLOP/s in `dtype`, or 0.0 if torch cannot run it on the CPU."""
    import torch

    def rate(size: int, budget_s: float) -> float:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        out = torch.empty(size, size, dtype=dtype)
        seconds = _median_seconds(lambda: torch.matmul(a, b, out=out), repeats=_REPEATS, budget_s=budget_s)
        return 2.0 * size**3 / seconds

    try:
        # A small probe sizes the real run so slow (emulated) precisions stay inside the budget.
        probe_flops_per_s = rate(_MATMUL_MIN_SIZE * 2, budget_s=_MATMUL_BUDGET_S / 4)
        per_run_s = _MATMUL_BUDGET_S / (_REPEATS + 1)
        size = int((probe_flops_per_s * per_run_s / 2.0) ** (1.0 / 3.0)) // 64 * 64
        size = min(_MATMUL_MAX_SIZE, max(_MATMUL_MIN_SIZE, size))
        return rate(size, budget_s=_MATMUL_BUDGET_S) / 1e12
    except (RuntimeError, TypeError, NotImplementedError):
        return 0.0


def _copy_bandwidth_gb_per_s(mem_bytes: int) -> float:
    """Measured copy bandwidth (bytes read + bytes written, as STREAM "Copy" counts) in GB/s."""
    import torch

    nbytes = min(_COPY_MAX_BYTES, max(2**20, mem_bytes // 16))
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), repeats=_REPEATS, budget_s=0.15)
    return 2.0 * src.numel() * src.element_size() / seconds / _BYTES_PER_GB


def _op_overhead_us() -> float:
    """Measured wall time of one tiny op (torch.add on 1-element tensors), in microseconds."""
    import torch

    a = torch.ones(1)
    b = torch.ones(1)
    out = torch.empty(1)
    calls = 500

    def batch() -> None:
        for _ in range(calls):
            torch.add(a, b, out=out)

    return _median_seconds(batch, repeats=_REPEATS, budget_s=0.05) / calls * 1e6


def _read_int_file(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for "no limit"


def _total_memory_bytes() -> int:
    """Physical memory of this machine, capped by a cgroup (container) memory limit if one is set."""
    total: int | None = None
    try:
        total = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024  # /proc/meminfo reports kB (KiB)
                    break
        except (OSError, ValueError, IndexError):
            total = None
    if total is None or total <= 0:
        raise InvalidArgument(
            "cannot determine this machine's memory (os.sysconf and /proc/meminfo both failed); "
            "describe the CPU as a JSON device file instead (see DeviceSpec.to_dict)"
        )
    for limit_path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        limit = _read_int_file(limit_path)
        if limit is not None and 0 < limit < total:
            total = limit
    return total


def measure_cpu_device(*, threads: int | None = None) -> DeviceSpec:
    """Benchmark this machine's CPU with torch (well under a second) and describe it as a DeviceSpec.

    Measured: fp64/fp32/fp16/bf16 matmul FLOP/s (0 where torch cannot run the dtype), copy
    bandwidth, per-op overhead and memory size. tf32 is 0 (CPUs have no TF32 mode). The host,
    intra- and inter-node links are loopback memcpy at the measured copy bandwidth (one machine,
    no network is modelled). The NVMe link is a documented default, not measured. Efficiencies are
    1.0 because the peaks are already achieved figures. `threads` sets torch's intra-op thread
    count for the measurement only (default: torch's current setting).
    """
    import torch

    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InvalidArgument(f"threads must be a positive int or None, got {threads!r}")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            mem_bytes = _total_memory_bytes()
            fp64 = _matmul_tflops(torch.float64)
            fp32 = _matmul_tflops(torch.float32)
            fp16 = _matmul_tflops(torch.float16)
            bf16 = _matmul_tflops(torch.bfloat16)
            copy_gb_per_s = _copy_bandwidth_gb_per_s(mem_bytes)
            overhead_us = _op_overhead_us()
    finally:
        if threads is not None:
            torch.set_num_threads(previous_threads)
    if fp32 <= 0.0:
        raise InvalidArgument(
            "fp32 matmul could not be measured on this CPU; describe it as a JSON device file instead"
        )
    loopback = LinkSpec(name="loopback memcpy (measured)", bandwidth_gb_per_s=copy_gb_per_s, latency_us=overhead_us)
    return DeviceSpec(
        name=_CPU_NAME,
        mem_bytes=mem_bytes,
        fp64_tflops=fp64,
        fp32_tflops=fp32,
        tf32_tflops=0.0,
        fp16_tflops=fp16,
        bf16_tflops=bf16,
        mem_bandwidth_gb_per_s=copy_gb_per_s,
        intra_node=loopback,
        # Same machine: "another node" is modelled as loopback too; a CPU cluster needs a JSON device.
        inter_node=dataclasses.replace(loopback, name="loopback memcpy (measured; no network modelled)"),
        host_link=loopback,
        nvme=NVME_GEN3_X4,  # not measured (disk benchmarks are slow and touch the filesystem)
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        kernel_overhead_us=overhead_us,
    )


class DeviceCatalog(Mapping[str, DeviceSpec]):
    """Read-only mapping of the GPU presets plus "cpu"; the CPU is measured on first access, once."""

    def __init__(
        self,
        presets: Mapping[str, DeviceSpec] = PRESETS,
        *,
        measure_cpu: Callable[[], DeviceSpec] = measure_cpu_device,
    ) -> None:
        if _CPU_NAME in presets:
            raise InvalidArgument(f"preset name {_CPU_NAME!r} is reserved for the measured CPU; rename the preset")
        self._presets: Mapping[str, DeviceSpec] = MappingProxyType(dict(presets))
        self._measure_cpu = measure_cpu
        self._cpu: DeviceSpec | None = None
        self._lock = threading.Lock()

    @property
    def cpu_measured(self) -> bool:
        """Whether the "cpu" entry has been measured yet."""
        return self._cpu is not None

    def __getitem__(self, name: str) -> DeviceSpec:
        if name == _CPU_NAME:
            with self._lock:
                if self._cpu is None:
                    self._cpu = self._measure_cpu()
                return self._cpu
        return self._presets[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._presets
        yield _CPU_NAME

    def __len__(self) -> int:
        return len(self._presets) + 1

    def __contains__(self, name: object) -> bool:  # avoids measuring the CPU for a membership test
        try:
            return name == _CPU_NAME or name in self._presets
        except TypeError:  # unhashable key
            return False

    def __repr__(self) -> str:
        cpu = "measured" if self.cpu_measured else "not measured yet"
        return f"DeviceCatalog(presets={list(self._presets)}, cpu={cpu})"


DEVICES = DeviceCatalog()
"""The process-wide catalog: the GPU presets plus the lazily measured "cpu"."""


# --------------------------------------------------------------------------------------------
# Lookup and JSON I/O.
# --------------------------------------------------------------------------------------------


def _normalise(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _json_help() -> str:
    return (
        "a custom device can be given as a path to a JSON file holding one object with the keys "
        f"{', '.join(_DEVICE_KEYS)} (each of {', '.join(_LINK_FIELDS)} is an object with keys "
        f"{', '.join(_LINK_KEYS)}); write one with save_device(spec, 'my_gpu.json') or "
        "json.dump(DeviceSpec.to_dict(), ...)"
    )


def get_device(spec: str | os.PathLike[str] | DeviceSpec) -> DeviceSpec:
    """Resolve a DeviceSpec, a preset or "cpu" name (case/punctuation-insensitive), or a device JSON path."""
    if isinstance(spec, DeviceSpec):
        return spec
    if isinstance(spec, os.PathLike):
        return load_device(spec)
    if not isinstance(spec, str):
        raise UnknownDevice(f"device must be a name, a JSON path or a DeviceSpec, got {spec!r} ({type(spec).__name__})")
    key = _normalise(spec)
    if key == _CPU_NAME:
        return DEVICES[_CPU_NAME]
    by_key = {_normalise(name): preset for name, preset in PRESETS.items()}
    if key and key in by_key:
        return by_key[key]
    # A bare model name ("H100") is accepted when exactly one preset carries it.
    same_model = [p for name, p in PRESETS.items() if key and _normalise(name.split("-")[0]) == key]
    if len(same_model) == 1:
        return same_model[0]
    if spec.lower().endswith(".json") or os.path.isfile(spec):
        return load_device(spec)
    hint = ""
    if len(same_model) > 1:
        hint = f"{spec!r} is ambiguous: say which of {', '.join(p.name for p in same_model)}; "
    raise UnknownDevice(
        f"unknown device {spec!r}: {hint}use one of the presets {', '.join(PRESETS)} or {_CPU_NAME!r} "
        f"(case and '-'/'_' do not matter), or {_json_help()}"
    )


def load_device(path: str | os.PathLike[str]) -> DeviceSpec:
    """Read a DeviceSpec from a JSON file written by `save_device` (or by hand with the same keys)."""
    where = os.fspath(path)
    try:
        text = Path(where).read_text(encoding="utf-8")
    except OSError as exc:
        raise UnknownDevice(f"cannot read device file {where!r}: {exc.strerror or exc}; {_json_help()}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnknownDevice(f"device file {where!r} is not valid JSON ({exc}); {_json_help()}") from exc
    if not isinstance(data, dict):
        raise UnknownDevice(
            f"device file {where!r} must hold one JSON object, got {type(data).__name__}; {_json_help()}"
        )
    try:
        return DeviceSpec.from_dict(data)
    except InvalidArgument as exc:
        raise UnknownDevice(f"device file {where!r}: {exc}") from exc


def save_device(spec: DeviceSpec, path: str | os.PathLike[str]) -> None:
    """Write `spec` as pretty-printed JSON that `load_device` reads back to an equal DeviceSpec."""
    if not isinstance(spec, DeviceSpec):
        raise InvalidArgument(f"save_device expects a DeviceSpec, got {spec!r} ({type(spec).__name__})")
    Path(path).write_text(json.dumps(spec.to_dict(), indent=2) + "\n", encoding="utf-8")
