"""The bottom package: the layer-graph IR and its capture (graph/), the error hierarchy, and what a
node costs (FLOPs, time, memory, communication; device presets; profiling).

It imports neither planner nor runtime. Attributes are imported lazily so reading a device preset
does not import the whole package.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "estimate": "cost_models.estimation",
    "CostTable": "cost_models.estimation",
    "NodeCost": "cost_models.estimation",
    "profile": "cost_models.profiling",
    "DEVICES": "cost_models.devices",
    "DeviceSpec": "cost_models.devices",
    "LinkSpec": "cost_models.devices",
    "get_device": "cost_models.devices",
    "load_device": "cost_models.devices",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cost_models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
