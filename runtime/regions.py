"""Cut a stage's GraphModule so that named runs of its nodes become submodules (``split_module``).

Recompute and swap (runtime/offload.py) both act on runs of a stage's nodes: each run becomes one
submodule, which is then wrapped (checkpointed, or run under the swap hooks). Every other node
stays in plain runs between them, cut in the original node order, so the stage computes exactly
as before: the same operations in the same order, hence the same random draws. The cut keeps the
stage's placeholders and outputs (its io in runtime/dataflow.py) and shares the stage's leaf
modules, so its parameters stay the model's own tensors (canonical names are found by identity).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch.fx

from cost_models.errors import RuntimeSetupError
from runtime.splitting import split_tupled

_NOT_COMPUTE = ("placeholder", "get_attr", "output")
_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                                operator.ior, operator.ixor, operator.ilshift, operator.irshift})


def compute_nodes(module: torch.fx.GraphModule) -> tuple[str, ...]:
    """The names of the nodes the stage computes (not its inputs, attributes or output), in order."""
    return tuple(node.name for node in module.graph.nodes if node.op not in _NOT_COMPUTE)


def check(module: torch.fx.GraphModule, regions: Mapping[str, Sequence[str]], *, stage: int,
          section: str = "offload") -> None:
    """Refuse, naming the region, runs the stage cannot cut into a submodule of their own.

    ``regions`` maps a label used in messages (``"recompute[0]"``) to node names; ``section`` is
    the part of the plan's stage that names them (``offload``, ``spatial``). Each run must
    name computation nodes of the stage (not its inputs), consecutive in the stage's order,
    disjoint from the other runs, and must not modify its own inputs in place (a recomputed or
    swapped run would then read the modified values).
    """
    compute = [node for node in module.graph.nodes if node.op not in _NOT_COMPUTE]
    position = {node.name: index for index, node in enumerate(compute)}
    inputs = {node.name for node in module.graph.nodes if node.op in ("placeholder", "get_attr")}
    claimed: dict[str, str] = {}
    for label, nodes in regions.items():
        def refuse(reason: str, label: str = label, nodes: Sequence[str] = nodes) -> RuntimeSetupError:
            return RuntimeSetupError(f"stage {stage}'s {section} {label} {list(nodes)} cannot be cut out of "
                                     f"the stage: {reason}; re-plan without it")

        outside = [name for name in nodes if name in inputs]
        if outside:
            raise refuse(f"{outside} are inputs of the stage (values it receives), not nodes it computes")
        strangers = [name for name in nodes if name not in position]
        if strangers:
            raise refuse(f"{strangers} are not nodes of the stage")
        places = [position[name] for name in nodes]
        if not nodes or places != list(range(places[0], places[0] + len(nodes))):
            raise refuse("its nodes are not a run of consecutive nodes in the stage's order")
        shared = sorted(name for name in nodes if name in claimed)
        if shared:
            raise refuse(f"{shared} are also in {claimed[shared[0]]}")
        claimed.update(dict.fromkeys(nodes, label))
        mutated = _mutated_inputs([compute[place] for place in places])
        if mutated:
            raise refuse(f"it modifies its inputs {mutated} in place")


def cut(module: torch.fx.GraphModule, regions: Mapping[str, Sequence[str]], *,
        stage: int, section: str = "offload") -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """``module`` with each region as one submodule; returns it and each label's submodule name.

    Example::

        split, names = cut(stage_module, {"recompute[0]": ("ln_2", "mlp_fc")}, stage=0)
        split.get_submodule(names["recompute[0]"])      # a GraphModule of ln_2 and mlp_fc
    """
    check(module, regions, stage=stage, section=section)
    region_of = {name: label for label, nodes in regions.items() for name in nodes}
    partition_of: dict[str, int] = {}
    partition = -1
    run: str | None = None
    for node in module.graph.nodes:
        if node.op in _NOT_COMPUTE:
            continue
        label = region_of.get(node.name)  # None: a plain node, kept in the run of plain nodes around it
        if partition < 0 or label != run:
            partition, run = partition + 1, label
        partition_of[node.name] = partition
    split = split_tupled(module, module, lambda node: partition_of[node.name], keep_original_order=True,
                         keep_original_node_name=True)
    _check_same_io(module, split, stage)
    return split, {label: f"submod_{partition_of[nodes[0]]}" for label, nodes in regions.items()}


def _mutated_inputs(nodes: Sequence[torch.fx.Node]) -> list[str]:
    """Values from outside ``nodes`` that one of them modifies in place."""
    inside = {node.name for node in nodes}
    mutated = []
    for node in nodes:
        inplace = (node.op == "call_function" and node.target in _INPLACE_OPERATORS
                   or node.op == "call_method" and str(node.target).endswith("_")
                   or node.op == "call_module" and getattr(node.graph.owning_module.get_submodule(
                       str(node.target)), "inplace", False) is True)
        first = node.args[0] if node.args else None
        if inplace and isinstance(first, torch.fx.Node) and first.name not in inside:
            mutated.append(first.name)
    return mutated


def _check_same_io(module: torch.fx.GraphModule, split: torch.fx.GraphModule, stage: int) -> None:
    def io(graph: torch.fx.Graph) -> tuple[list[str], object]:
        output = next(node for node in graph.nodes if node.op == "output")
        return ([node.name for node in graph.nodes if node.op == "placeholder"],
                torch.fx.node.map_arg(output.args, lambda _: "value"))

    if io(module.graph) != io(split.graph):
        raise AssertionError(f"cutting stage {stage} changed its inputs or outputs: {io(module.graph)} "
                             f"became {io(split.graph)}")
