"""tessera's compiler: trace a model, cost it, and plan its partition (public API below).

Attributes are imported lazily so ``import planner`` (and reading plan files) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "trace": "planner.tracing",
    "LayerGraph": "planner.graph",
    "LayerNode": "planner.graph",
    "NodeKind": "planner.graph",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
