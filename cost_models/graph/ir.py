"""The LayerGraph IR: a frozen, topologically ordered description of a traced model."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator, Mapping


class NodeKind(str, Enum):
    """What an fx node does; the values follow torch.fx's op names."""

    INPUT = "placeholder"
    PARAM = "get_attr"
    MODULE = "call_module"
    FUNCTION = "call_function"
    METHOD = "call_method"
    OUTPUT = "output"


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and size of one tensor a node produces."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    requires_grad: bool = False
    python: bool = False  # a Python scalar or tuple of ints, as the tensor it crosses a cut as: fixed size

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "nbytes": self.nbytes,
                "requires_grad": self.requires_grad, "python": self.python}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TensorMeta":
        return cls(tuple(data["shape"]), data["dtype"], data["nbytes"], data["requires_grad"],
                   bool(data.get("python", False)))


@dataclass(frozen=True)
class Geometry:
    """Sliding-window geometry of a convolution or pooling node (per spatial dimension)."""

    op: str  # "conv", "conv_transpose", "max_pool", "avg_pool"
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    padding_mode: str = "zeros"
    ceil_mode: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "kernel": list(self.kernel), "stride": list(self.stride),
                "padding": list(self.padding), "dilation": list(self.dilation),
                "padding_mode": self.padding_mode, "ceil_mode": self.ceil_mode}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Geometry":
        return cls(data["op"], tuple(data["kernel"]), tuple(data["stride"]), tuple(data["padding"]),
                   tuple(data["dilation"]), data["padding_mode"], data["ceil_mode"])


@dataclass(frozen=True)
class NodeWork:
    """What one node costs, measured once on fake tensors while tracing.

    FLOPs come from torch.utils.flop_counter. The storages autograd keeps for the backward pass
    (de-duplicated by storage, parameters excluded; keyed by dtype name so precision changes can
    rescale them) are counted three times over (cost_models.fake_measure.StorageLedger):
    ``saved_bytes_by_dtype`` holds those this node allocates (what the stage holding it keeps),
    ``released_bytes_by_dtype`` those it is the last to save (what recomputing or swapping it
    releases), ``freed_bytes_by_dtype`` those it is the first to save (what autograd frees once its
    backward has run). All add up to the same over a whole graph.
    """

    fwd_flops: int = 0
    bwd_flops: int = 0
    saved_bytes_by_dtype: tuple[tuple[str, int], ...] = ()
    released_bytes_by_dtype: tuple[tuple[str, int], ...] = ()
    freed_bytes_by_dtype: tuple[tuple[str, int], ...] = ()

    @property
    def saved_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.saved_bytes_by_dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"fwd_flops": self.fwd_flops, "bwd_flops": self.bwd_flops,
                "saved_bytes_by_dtype": dict(self.saved_bytes_by_dtype),
                "released_bytes_by_dtype": dict(self.released_bytes_by_dtype),
                "freed_bytes_by_dtype": dict(self.freed_bytes_by_dtype)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "NodeWork":
        saved = tuple(sorted(data["saved_bytes_by_dtype"].items()))
        released = data.get("released_bytes_by_dtype")  # absent: written before it was measured
        freed = data.get("freed_bytes_by_dtype")  # (by the producer: what it frees comes no sooner)
        return cls(data["fwd_flops"], data["bwd_flops"], saved,
                   saved if released is None else tuple(sorted(released.items())),
                   saved if freed is None else tuple(sorted(freed.items())))


@dataclass(frozen=True)
class ParamInfo:
    """One unique parameter or buffer; ``owner`` is the first node that uses it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    is_buffer: bool
    owner: str
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return functools.reduce(lambda a, b: a * b, self.shape, 1)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "nbytes": self.nbytes, "is_buffer": self.is_buffer, "owner": self.owner,
                "aliases": list(self.aliases)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParamInfo":
        return cls(data["name"], tuple(data["shape"]), data["dtype"], data["nbytes"],
                   data["is_buffer"], data["owner"], tuple(data["aliases"]))


@dataclass(frozen=True)
class LayerNode:
    """One node of the traced graph with everything the cost models and planner need."""

    name: str
    kind: NodeKind
    target: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[TensorMeta, ...]
    param_names: tuple[str, ...] = ()
    geometry: Geometry | None = None
    spatially_splittable: bool = False
    work: NodeWork = field(default_factory=NodeWork)
    crosses: bool = True  # its value can cross a stage boundary (shapes.crosses_boundary): no cut while it lives

    @property
    def output_bytes(self) -> int:
        return sum(meta.nbytes for meta in self.outputs)

    @property
    def output_shape(self) -> tuple[int, ...] | None:
        """Shape of the first tensor output (None when the node produces no tensor)."""
        return next((meta.shape for meta in self.outputs if not meta.python), None)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind.value, "target": self.target,
                "op_type": self.op_type, "inputs": list(self.inputs),
                "outputs": [meta.to_dict() for meta in self.outputs],
                "param_names": list(self.param_names),
                "geometry": self.geometry.to_dict() if self.geometry else None,
                "spatially_splittable": self.spatially_splittable, "work": self.work.to_dict(),
                "crosses": self.crosses}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LayerNode":
        geometry = Geometry.from_dict(data["geometry"]) if data["geometry"] else None
        return cls(data["name"], NodeKind(data["kind"]), data["target"], data["op_type"],
                   tuple(data["inputs"]), tuple(TensorMeta.from_dict(m) for m in data["outputs"]),
                   tuple(data["param_names"]), geometry, data["spatially_splittable"],
                   NodeWork.from_dict(data["work"]), bool(data.get("crosses", True)))


@dataclass(frozen=True)
class LayerGraph:
    """A traced model: nodes in topological order plus its unique parameters and buffers.

    Example::

        g = planner.trace(model, (torch.randn(8, 3, 224, 224),))
        g.node("layer1_0_conv1").work.fwd_flops
        g.param_bytes, g.fingerprint, g.to_networkx()
    """

    nodes: tuple[LayerNode, ...]
    parameters: tuple[ParamInfo, ...]
    tracer: str  # "fx" or "export"

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for node in self.nodes:
            missing = [name for name in node.inputs if name not in seen]
            assert not missing, f"node {node.name} reads {missing} before they are defined"
            seen.add(node.name)

    def __iter__(self) -> Iterator[LayerNode]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @functools.cached_property
    def _by_name(self) -> dict[str, LayerNode]:
        return {node.name: node for node in self.nodes}

    def node(self, name: str) -> LayerNode:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no node named {name!r} in this graph ({len(self.nodes)} nodes)") from None

    @functools.cached_property
    def users(self) -> Mapping[str, tuple[str, ...]]:
        """For every node, the nodes that read its output, in topological order."""
        readers: dict[str, list[str]] = {node.name: [] for node in self.nodes}
        for node in self.nodes:
            for source in dict.fromkeys(node.inputs):
                readers[source].append(node.name)
        return {name: tuple(names) for name, names in readers.items()}

    @functools.cached_property
    def _params_by_name(self) -> dict[str, ParamInfo]:
        return {info.name: info for info in self.parameters}

    def parameter(self, name: str) -> ParamInfo:
        return self._params_by_name[name]

    @functools.cached_property
    def owned_param_numel(self) -> Mapping[str, int]:
        """Parameter elements per node, each unique parameter counted once at its first user."""
        owned = {node.name: 0 for node in self.nodes}
        for info in self.parameters:
            if not info.is_buffer:
                owned[info.owner] += info.numel
        return owned

    @functools.cached_property
    def owned_param_bytes(self) -> Mapping[str, int]:
        """Parameter bytes per node, each unique parameter counted once at its first user."""
        owned = {node.name: 0 for node in self.nodes}
        for info in self.parameters:
            if not info.is_buffer:
                owned[info.owner] += info.nbytes
        return owned

    @functools.cached_property
    def owned_buffer_bytes(self) -> Mapping[str, int]:
        owned = {node.name: 0 for node in self.nodes}
        for info in self.parameters:
            if info.is_buffer:
                owned[info.owner] += info.nbytes
        return owned

    @property
    def param_bytes(self) -> int:
        return sum(info.nbytes for info in self.parameters if not info.is_buffer)

    @property
    def param_count(self) -> int:
        return sum(info.numel for info in self.parameters if not info.is_buffer)

    @property
    def batch_size(self) -> int:
        """Leading dimension of the first input: the batch the costs were measured at."""
        first = self.input_nodes[0]
        return first.outputs[0].shape[0] if first.outputs and first.outputs[0].shape else 1

    @property
    def input_nodes(self) -> tuple[LayerNode, ...]:
        return tuple(node for node in self.nodes if node.kind is NodeKind.INPUT)

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 over names, targets, edges, and tensor shapes and dtypes; equal graphs share it (a Python
        value's wire form is derived from the graph, so it is left out: plan files keep matching)."""
        digest = hashlib.sha256()
        for node in self.nodes:
            record = [node.name, node.kind.value, node.target, list(node.inputs),
                      [[list(meta.shape), meta.dtype] for meta in node.outputs if not meta.python],
                      list(node.param_names)]
            digest.update(json.dumps(record, separators=(",", ":")).encode())
        return digest.hexdigest()

    def to_networkx(self) -> Any:
        """A networkx.DiGraph view (edges from producer to consumer, weighted by bytes)."""
        import networkx as nx

        view = nx.DiGraph()
        for node in self.nodes:
            view.add_node(node.name, node=node)
            for source in node.inputs:
                view.add_edge(source, node.name, nbytes=self.node(source).output_bytes)
        return view

    def to_dict(self) -> dict[str, Any]:
        return {"tracer": self.tracer, "fingerprint": self.fingerprint,
                "nodes": [node.to_dict() for node in self.nodes],
                "parameters": [info.to_dict() for info in self.parameters]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LayerGraph":
        graph = cls(tuple(LayerNode.from_dict(n) for n in data["nodes"]),
                    tuple(ParamInfo.from_dict(p) for p in data["parameters"]), data["tracer"])
        if "fingerprint" in data and data["fingerprint"] != graph.fingerprint:
            raise ValueError(f"graph fingerprint {data['fingerprint']} does not match its nodes "
                             f"({graph.fingerprint}); the data was edited or corrupted")
        return graph
