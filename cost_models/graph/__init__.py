"""The layer-graph IR and its capture: trace a model (torch.fx, torch.export fallback) into a LayerGraph.

``ir`` is the standard-library-only IR; ``capture`` and ``tracing`` import torch. Attributes are
imported lazily so reading the IR stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LayerGraph": "cost_models.graph.ir",
    "LayerNode": "cost_models.graph.ir",
    "NodeKind": "cost_models.graph.ir",
    "TensorMeta": "cost_models.graph.ir",
    "Geometry": "cost_models.graph.ir",
    "trace": "cost_models.graph.tracing",
    "trace_module": "cost_models.graph.tracing",
    "rebuild_graph": "cost_models.graph.tracing",
    "normalise_inputs": "cost_models.graph.tracing",
    "LeafSpec": "cost_models.graph.capture",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cost_models.graph' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
