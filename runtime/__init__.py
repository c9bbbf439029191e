"""tessera's executor: runs a saved plan under torchrun, or inside a user's script.

Example (a script started by torchrun; the Executor joins the process group if it is not yet)::

    import runtime
    exe = runtime.Executor(plan, model, loss_fn, lambda params: torch.optim.Adam(params))
    loss = exe.step(inputs, targets)
    runtime.initialize(reference_model, seed=0)   # the weights every rank's stages start from
"""

from __future__ import annotations

from typing import Any

__all__ = ["Executor", "RunReport", "initialize"]


def __getattr__(name: str) -> Any:  # imported lazily: `import runtime.spatial` stays light
    if name == "Executor":
        from runtime.executor import Executor

        return Executor
    if name == "initialize":
        from runtime.weights import initialize

        return initialize
    if name == "RunReport":
        from planner.reports.run_report import RunReport

        return RunReport
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
