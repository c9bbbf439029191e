"""Plan files of earlier schema versions, rewritten into the current one on load.

Schema 1 (tessera before the layout) kept each stage's ranks in the stage and assumed stage s of
replica r on rank s * data_parallel + r; schema 2 stores the layout, per-part costs (memory held
all step and per micro-batch in flight) and per-stage in-flight counts. Schema 3 writes a stage's
memory decisions as checkpoint regions, swapped nodes and a ZeRO stage instead of a per-node
policy map. Nothing is lost: an older plan runs exactly as it did.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cost_models.errors import PlanFileError

SCHEMA_VERSION = 3


def upgrade(data: Any) -> Mapping[str, Any]:
    """``data`` in the current schema (a new dict when it was older); refuses unknown versions."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a plan must be a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version == SCHEMA_VERSION:
        return data
    if version in (1, 2):
        try:
            return _from_v2(_from_v1(data) if version == 1 else data)
        except (KeyError, TypeError, AttributeError, ZeroDivisionError) as error:
            raise ValueError(f"schema-{version} plan lacks or garbles {error!s} and cannot be upgraded") from None
    raise PlanFileError(f"plan schema_version is {version!r} but this tessera reads versions 1 to "
                        f"{SCHEMA_VERSION}; re-create the plan with `tessera plan` (or use the tessera "
                        f"that wrote it)")


def _from_v1(data: Mapping[str, Any]) -> dict[str, Any]:
    new = {key: value for key, value in data.items() if key != "data_parallel"}
    stages = data["stages"]
    replicas = int(data["data_parallel"])
    for index, stage in enumerate(stages):
        if replicas < 1 or len(stage["ranks"]) != replicas:
            raise ValueError(f"data_parallel is {replicas} but stages[{index}].ranks lists "
                             f"{len(stage['ranks'])} ranks; it must list one rank per replica")
    slot_ranks = [[[stage["ranks"][replica]] for stage in stages] for replica in range(replicas)]
    new["layout"] = {"stage_part": list(range(len(stages))), "stage_slot": list(range(len(stages))),
                     "slot_ranks": slot_ranks}
    new["stages"] = [_stage_from_v1(stage) for stage in stages]
    new["schedule"] = {"kind": data["schedule"]["kind"],
                       "in_flight": [stage["predicted"]["in_flight"] for stage in stages]}
    solver = dict(data["solver"])
    if solver.get("runner_up") is not None:
        solver["runner_up"] = {key: solver["runner_up"][key] for key in
                               ("num_stages", "data_parallel", "micro_batch_size", "schedule", "step_ms")}
    new["solver"] = solver
    new["schema_version"] = 2
    return new


def _from_v2(data: Mapping[str, Any]) -> dict[str, Any]:
    """Per-node policies become checkpoint regions (one per recomputed node) and swapped nodes."""
    stages = []
    for stage in data["stages"]:
        offload = stage["offload"]
        policies = offload["activations"]
        if not isinstance(policies, Mapping):
            raise TypeError("stages[].offload.activations")
        stages.append({**stage, "offload": {
            "recompute": [[node] for node in stage["nodes"] if policies.get(node) == "recompute"],
            "swap": [node for node in stage["nodes"] if policies.get(node) == "host"],
            "zero_stage": 0, "optimizer_state": offload["optimizer_state"], "params": offload["params"]}})
    return {**data, "stages": stages, "schema_version": SCHEMA_VERSION}


def _stage_from_v1(stage: Mapping[str, Any]) -> dict[str, Any]:
    predicted = stage["predicted"]
    held = predicted["activation_bytes"]  # in-flight micro-batches x (saved + received)
    return {"index": stage["index"], "nodes": stage["nodes"], "spatial": stage["spatial"],
            "offload": stage["offload"],
            "predicted": {"fwd_ms": predicted["fwd_ms"], "bwd_ms": predicted["bwd_ms"],
                          "param_bytes": predicted["param_bytes"],
                          "static_bytes": predicted["peak_mem_bytes"] - held,
                          "activation_bytes": held // predicted["in_flight"],
                          "allreduce_ms": predicted["allreduce_ms"]}}
