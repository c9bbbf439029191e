"""estimate(): the per-node cost table (FLOPs, time, memory) of a LayerGraph on a device."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from cost_models.devices import DeviceSpec, get_device
from cost_models.errors import InvalidArgument
from cost_models.graph.ir import LayerGraph, LayerNode, NodeKind
from cost_models.loss import LOSS_FLOPS_PER_ELEMENT
from cost_models.memory import (
    Optimizer,
    Precision,
    activation_bytes,
    get_optimizer,
    get_precision,
    model_state_bytes,
    rescale_bytes,
)
from cost_models.roofline import NodeTraffic, node_times_ms

_COMPUTE_KINDS = (NodeKind.MODULE, NodeKind.FUNCTION, NodeKind.METHOD)


@dataclass(frozen=True)
class NodeCost:
    """What one node costs per micro-batch of the traced batch size."""

    name: str
    fwd_flops: int
    bwd_flops: int
    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    saved_activation_bytes: int  # saved for the backward, of what it allocates: what its stage keeps
    output_bytes: int
    measured_fwd_peak_bytes: int | None = None  # CUDA profile only: peak allocated in forward
    measured_bwd_bytes: int | None = None  # profiled: the most its backward allocated (its inputs' and weights'
    # gradients, the kernel's workspace) beside its output's gradient; None: estimated (planner/search/working.py)
    split_ms: tuple[float, float] | None = None  # profiled: a split backward's I and W, each alone (its W cold)
    released_bytes: int | None = None  # saved, of what it is the last to save: what recomputing or swapping
    # it releases (cost_models.graph.ir.NodeWork); None: saved_activation_bytes (a table written before)
    freed_bytes: int | None = None  # saved, of what it is the first to save: what autograd frees once its
    # backward has run (the later savers' ran before it); None: saved_activation_bytes (a table written before)

    @property
    def released_activation_bytes(self) -> int:
        return self.saved_activation_bytes if self.released_bytes is None else self.released_bytes

    @property
    def freed_activation_bytes(self) -> int:
        return self.saved_activation_bytes if self.freed_bytes is None else self.freed_bytes

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes

    @property
    def weight_grad_ms(self) -> float:
        """What a split backward's W takes: its measured time (``split_ms``), or else the share of ``bwd_ms``
        that computes its own parameters' gradients: the weight gradient of a matmul or convolution takes
        as many FLOPs as its forward, so that share of the backward's FLOPs. 0 for a node without
        trainable parameters."""
        if self.split_ms is not None:
            return self.split_ms[1]
        if not self.grad_bytes or not self.bwd_flops:
            return 0.0
        return self.bwd_ms * min(self.fwd_flops, self.bwd_flops) / self.bwd_flops

    @property
    def split_extra_ms(self) -> float:
        """What splitting its backward into I and W costs beyond one whole backward (measured; 0 unless
        profiled): W runs later, from a cold cache, on the output gradients I kept, and ops that make
        input and weight gradients together (a LayerNorm's backward) run in both. A split backward's I
        takes ``bwd_ms - weight_grad_ms + split_extra_ms``. Never below 0 (a split does the whole
        backward's work; timing noise can say less)."""
        if self.split_ms is None:
            return 0.0
        return max(0.0, self.split_ms[0] + self.split_ms[1] - self.bwd_ms)


@dataclass(frozen=True)
class CostTable(Mapping[str, NodeCost]):
    """Costs of every node of one graph, in topological order, with how they were obtained.

    ``source`` is ``"roofline"`` for estimates or ``"measured"`` when times were profiled.
    """

    costs: tuple[NodeCost, ...]
    fingerprint: str
    device: str
    optimizer: str
    precision: str
    source: str

    @functools.cached_property
    def _by_name(self) -> dict[str, NodeCost]:
        return {cost.name: cost for cost in self.costs}

    def __getitem__(self, name: str) -> NodeCost:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self.costs)

    def total(self, field: str) -> float:
        """Sum of one NodeCost field over all nodes, e.g. ``table.total("fwd_ms")``."""
        return sum(getattr(cost, field) for cost in self.costs)

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "device": self.device, "optimizer": self.optimizer,
                "precision": self.precision, "source": self.source,
                "nodes": [dataclasses.asdict(cost) for cost in self.costs]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostTable":
        return cls(tuple(NodeCost(**row) for row in data["nodes"]), data["fingerprint"],
                   data["device"], data["optimizer"], data["precision"], data["source"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        return cls.from_dict(json.loads(Path(path).read_text()))


def estimate(graph: LayerGraph, device: str | DeviceSpec = "V100-16GB", optimizer: str | Optimizer = "adam",
             precision: str | Precision | None = None, *, batch_size: int | None = None) -> CostTable:
    """Cost every node of ``graph``: FLOPs from tracing, time by roofline on ``device``.

    ``precision`` defaults to the model's own (:func:`model_precision`: its weights' dtype).
    ``batch_size`` rescales everything that grows with the batch (FLOPs, activations, outputs)
    from the traced batch (``graph.batch_size``) to that micro-batch size; weights do not scale.

    Example::

        costs = estimate(trace(model, inputs), device="A100-80GB", optimizer="adam",
                         precision="bf16")
        costs["layer1_0_conv1"].fwd_ms, costs.total("param_bytes")
    """
    spec = get_device(device)
    mode = model_precision(graph) if precision is None else get_precision(precision)
    state = get_optimizer(optimizer)  # validates the names before any work
    if mode.value not in spec.supported_precisions():
        raise InvalidArgument(f"device {spec.name!r} cannot train in {mode.value}; it supports "
                              f"{', '.join(spec.supported_precisions())}")
    if batch_size is not None and batch_size < 1:
        raise InvalidArgument(f"batch_size must be >= 1, got {batch_size}")
    scale = 1.0 if batch_size is None else batch_size / graph.batch_size
    costs = tuple(_node_cost(graph, node, spec, mode, state, scale) for node in graph)
    return CostTable(costs, graph.fingerprint, spec.name, state.value, mode.value, "roofline")


def model_precision(graph: LayerGraph) -> Precision:
    """The precision a model trains in as built: its floating-point weights' dtype (fp32 or fp64).

    Half-precision weights are refused: say whether they mean mixed precision (fp16/bf16 with fp32
    master weights). A model without floating-point weights counts as fp32.
    """
    dtypes = sorted({info.dtype for info in graph.parameters if not info.is_buffer
                     and info.dtype in ("float64", "float32", "float16", "bfloat16")})
    by_dtype = {"float64": Precision.FP64, "float32": Precision.FP32}
    if len(dtypes) == 1 and dtypes[0] in by_dtype:
        return by_dtype[dtypes[0]]
    if not dtypes:
        return Precision.FP32
    raise InvalidArgument(f"the model's weights are {', '.join(dtypes)}: give precision= (--precision) "
                          f"explicitly, e.g. 'bf16' or 'fp16' for mixed precision with fp32 master weights, "
                          f"or 'fp32'")


def _node_cost(graph: LayerGraph, node: LayerNode, device: DeviceSpec, precision: Precision,
               optimizer: Optimizer, scale: float) -> NodeCost:
    state = model_state_bytes(graph.owned_param_numel[node.name], precision, optimizer)
    output_bytes = _output_bytes(node, precision, scale)
    fwd_flops, bwd_flops = round(node.work.fwd_flops * scale), round(node.work.bwd_flops * scale)
    fwd_ms = bwd_ms = 0.0
    if node.kind in _COMPUTE_KINDS:
        input_bytes = sum(_output_bytes(graph.node(source), precision, scale) for source in node.inputs
                          if graph.node(source).kind is not NodeKind.PARAM)
        used_param_bytes = sum(_param_bytes(graph, name, precision) for name in node.param_names)
        traffic = NodeTraffic(fwd_flops, bwd_flops, input_bytes, output_bytes, used_param_bytes,
                              any(meta.requires_grad for meta in node.outputs))
        fwd_ms, bwd_ms = node_times_ms(node.op_type, traffic, device, precision)
    elif node.kind is NodeKind.OUTPUT:
        fwd_ms, bwd_ms = _loss_ms(graph, node, device, precision, scale)
    saved = activation_bytes(node.work.saved_bytes_by_dtype, precision)
    released = activation_bytes(node.work.released_bytes_by_dtype, precision)
    freed = activation_bytes(node.work.freed_bytes_by_dtype, precision)
    return NodeCost(
        name=node.name, fwd_flops=fwd_flops, bwd_flops=bwd_flops,
        fwd_ms=fwd_ms, bwd_ms=bwd_ms, param_bytes=state.param_bytes, grad_bytes=state.grad_bytes,
        optimizer_bytes=state.optimizer_bytes, buffer_bytes=graph.owned_buffer_bytes[node.name],
        saved_activation_bytes=round(saved * scale), output_bytes=output_bytes,
        released_bytes=round(released * scale), freed_bytes=round(freed * scale))


def _loss_ms(graph: LayerGraph, node: LayerNode, device: DeviceSpec, precision: Precision,
             scale: float) -> tuple[float, float]:
    """The training loss on the model's output (cost_models/loss.py), costed on the output node: a few
    operations per element, reading the output and writing as much (its gradient, backward)."""
    outputs = [meta for source in node.inputs for meta in graph.node(source).outputs
               if meta.requires_grad and not meta.python]
    output_bytes = round(sum(rescale_bytes(meta.nbytes, meta.dtype, precision) for meta in outputs) * scale)
    flops = round(LOSS_FLOPS_PER_ELEMENT * sum(math.prod(meta.shape) for meta in outputs) * scale)
    if not output_bytes:
        return 0.0, 0.0
    return node_times_ms("loss", NodeTraffic(flops, flops, output_bytes, output_bytes, 0, True), device, precision)


def _output_bytes(node: LayerNode, precision: Precision, scale: float) -> int:
    """Output bytes at the scaled batch; weights read through get_attr and Python values do not scale."""
    fixed = sum(meta.nbytes for meta in node.outputs if meta.python)
    nbytes = sum(rescale_bytes(meta.nbytes, meta.dtype, precision) for meta in node.outputs if not meta.python)
    return fixed + (nbytes if node.kind is NodeKind.PARAM else round(nbytes * scale))


def _param_bytes(graph: LayerGraph, name: str, precision: Precision) -> int:
    info = graph.parameter(name)
    return rescale_bytes(info.nbytes, info.dtype, precision)
