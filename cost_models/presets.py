"""GPU presets (V100, A100, H100, H200) and their links; every figure cites its public source."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from cost_models.device_spec import DeviceSpec, LinkSpec

_GIB = 2**30

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
# An optimizer step on the host: a vectorised CPU Adam reads and writes ~16 bytes of fp32 state per
# parameter, bounded by the host's memory bandwidth (~100 GB/s per socket on these systems) shared by
# the node's GPUs: of the order of 0.4e9 parameters per second per GPU's share. Measure it.
_HOST_OPTIMIZER_PARAMS_PER_S = 4e8

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
    host_mem_bytes=64 * _GIB,  # per GPU: DGX-1 system description: 512 GB DDR4 for 8 GPUs
    nvme_bytes=960_000_000_000,  # per GPU: DGX-1: 4x 1.92 TB SSD (7.68 TB) for 8 GPUs
    host_optimizer_params_per_s=_HOST_OPTIMIZER_PARAMS_PER_S,  # calibration default, not a datasheet figure
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
    host_mem_bytes=96 * _GIB,  # per GPU: DGX-2 system description: 1.5 TB DDR4 for 16 GPUs
    nvme_bytes=1_875_000_000_000,  # per GPU: DGX-2: 30 TB NVMe for 16 GPUs
    host_optimizer_params_per_s=_HOST_OPTIMIZER_PARAMS_PER_S,  # calibration default, not a datasheet figure
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
    host_mem_bytes=128 * _GIB,  # per GPU: DGX A100 (320 GB) system description: 1 TB DDR4 for 8 GPUs
    nvme_bytes=1_875_000_000_000,  # per GPU: DGX A100: 15 TB NVMe for 8 GPUs
    host_optimizer_params_per_s=_HOST_OPTIMIZER_PARAMS_PER_S,  # calibration default, not a datasheet figure
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
    host_mem_bytes=256 * _GIB,  # per GPU: DGX A100 (640 GB) system description: 2 TB DDR4 for 8 GPUs
    nvme_bytes=3_750_000_000_000,  # per GPU: DGX A100 (640 GB): 30 TB NVMe for 8 GPUs
    host_optimizer_params_per_s=_HOST_OPTIMIZER_PARAMS_PER_S,  # calibration default, not a datasheet figure
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
    host_mem_bytes=256 * _GIB,  # per GPU: DGX H100 system description: 2 TB DDR5 for 8 GPUs
    nvme_bytes=3_840_000_000_000,  # per GPU: DGX H100: 8x 3.84 TB U.2 NVMe for 8 GPUs
    host_optimizer_params_per_s=_HOST_OPTIMIZER_PARAMS_PER_S,  # calibration default, not a datasheet figure
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
    host_mem_bytes=256 * _GIB,  # per GPU: DGX H200 system description: 2 TB DDR5 for 8 GPUs
    nvme_bytes=3_840_000_000_000,  # per GPU: DGX H200: 8x 3.84 TB U.2 NVMe for 8 GPUs
    host_optimizer_params_per_s=_HOST_OPTIMIZER_PARAMS_PER_S,  # calibration default, not a datasheet figure
)

PRESETS: Mapping[str, DeviceSpec] = MappingProxyType(
    {spec.name: spec for spec in (V100_16GB, V100_32GB, A100_40GB, A100_80GB, H100_80GB, H200_141GB)}
)
"""Read-only mapping of the GPU presets by canonical name (e.g. "A100-80GB")."""

