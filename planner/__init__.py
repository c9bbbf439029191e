"""tessera's compiler: trace a model, cost it, and plan its partition (public API below).

Attributes are imported lazily so ``import planner`` (and reading plan files) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "trace": "cost_models.graph.tracing",
    "LayerGraph": "cost_models.graph.ir",
    "LayerNode": "cost_models.graph.ir",
    "NodeKind": "cost_models.graph.ir",
    "plan": "planner.api",
    "Plan": "planner.plan",
    "Layout": "planner.plan",
}

__all__ = sorted(_EXPORTS)

# The plan-file package is planner/plan/ while planner.plan() is the planning function. Load the
# module now (standard library only) and drop the attribute the import system set, so the name
# `plan` on this package always resolves, through __getattr__, to the function.
importlib.import_module("planner.plan")
del globals()["plan"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
