"""Roofline time of one node: the slower of its FLOPs and its memory traffic, plus launch cost."""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.devices import DeviceSpec
from cost_models.memory import Precision

# Ops that only reinterpret metadata (no kernel, no traffic): views, shape queries, indexing a tuple.
VIEW_OPS = frozenset({
    "view", "reshape", "flatten", "unflatten", "size", "getitem", "getattr", "t", "transpose",
    "permute", "unsqueeze", "squeeze", "expand", "expand_as", "split", "chunk", "narrow", "select",
    "unbind", "view_as", "detach", "alias", "_unsafe_view", "Flatten", "Unflatten", "Identity",
    "split_with_sizes", "slice", "dim",
})


@dataclass(frozen=True)
class NodeTraffic:
    """What a node computes and moves, in the training precision."""

    fwd_flops: int
    bwd_flops: int
    input_bytes: int
    output_bytes: int
    param_bytes: int
    needs_backward: bool


def roofline_ms(flops: int, traffic_bytes: int, device: DeviceSpec, precision: Precision) -> float:
    """max(compute, memory) time in milliseconds plus one kernel launch."""
    compute_s = flops / (device.peak_flops(precision.value) * device.matmul_efficiency)
    memory_s = traffic_bytes / (device.mem_bandwidth_bytes_per_s() * device.memory_efficiency)
    return max(compute_s, memory_s) * 1e3 + device.kernel_overhead_us * 1e-3


def node_times_ms(op_type: str, traffic: NodeTraffic, device: DeviceSpec,
                  precision: Precision) -> tuple[float, float]:
    """Forward and backward milliseconds of one node.

    Forward reads inputs and weights and writes outputs; backward reads the output gradient,
    the saved inputs and the weights and writes input and weight gradients (about twice the
    forward traffic). View-like ops cost nothing.
    """
    if op_type in VIEW_OPS:
        return 0.0, 0.0
    activations = traffic.input_bytes + traffic.output_bytes
    fwd_ms = roofline_ms(traffic.fwd_flops, activations + traffic.param_bytes, device, precision)
    if not traffic.needs_backward:
        return fwd_ms, 0.0
    bwd_ms = roofline_ms(traffic.bwd_flops, 2 * (activations + traffic.param_bytes), device, precision)
    return fwd_ms, bwd_ms
