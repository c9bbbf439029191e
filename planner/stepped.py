"""What each stage's optimizer steps, in the runtime's order, and what its worst bucket allocates.

The search bounds a part's optimizer step by a bucket as large as the step's limit (planner/search/terms.py:
``_step_term``), because a partition's parameters are not known in order there. Once the partition is
chosen they are: the runtime (runtime/stage_optimizer.py) steps a stage's parameters in buckets packed in
the order its ``torch.fx`` module lists them (cost_models.memory.step_buckets), each parameter stepped by the
first of a rank's stages using it. This module packs them the same way, so the assembled plan predicts the
step's buffers its runtime allocates, not their bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_models.graph.ir import LayerGraph, NodeKind
from cost_models.memory import shard_numel, step_bucket_bytes, step_buckets
from planner.plan import Layout
from planner.search.problem import PipelineProblem
from planner.search.terms import step_bucket_bytes_of


def module_order(graph: LayerGraph, nodes: Sequence[str]) -> tuple[str, ...]:
    """The canonical names of the trainable parameters a stage of ``nodes`` (in graph order) uses, in the
    order the runtime lists them (runtime/build.py: ``stage_tensors``): its module's ``parameters()``, then
    the parameters it reads through ``get_attr``.

    ``torch.fx``'s ``split_module`` registers each ``call_module`` target of a stage on the stage's module at
    its first node, so the called modules' parameters come in node order; a parameter read through
    ``get_attr`` is an input of the stage, and inputs come in the order the stage's nodes first use them.
    """
    called: list[str] = []
    for name in nodes:
        node = graph.node(name)
        if node.kind is NodeKind.MODULE:
            read = {p for source in node.inputs if graph.node(source).kind is NodeKind.PARAM
                    for p in graph.node(source).param_names}
            called += [p for p in node.param_names if p not in read]
    inputs = [p for name in nodes if graph.node(name).kind is not NodeKind.PARAM for p in graph.node(name).param_names]
    return tuple(p for p in dict.fromkeys([*called, *inputs]) if not graph.parameter(p).is_buffer)


def stage_step_bytes(graph: LayerGraph, problem: PipelineProblem, layout: Layout,
                     part_nodes: Sequence[Sequence[str]]) -> tuple[float | None, ...]:
    """Per part, what its optimizer step allocates beyond the model state at its worst bucket, as the runtime
    packs it: the most over the ranks computing the part (a rank holding several stages steps a shared
    parameter at the first of them). None where the problem costs no step (no precision and optimizer)."""
    used = [module_order(graph, nodes) for nodes in part_nodes]
    users: dict[str, set[int]] = {}
    for part, names in enumerate(used):
        for name in names:
            users.setdefault(name, set()).add(part)
    precision = problem.tiers.precision
    worst: list[float | None] = [None] * len(part_nodes)
    # ranks computing the same parts in the same order step the same buckets: each such sequence is packed once
    sequences = dict.fromkeys(tuple(layout.part(stage) for stage in sorted(layout.stages_of_rank(rank)))
                              for rank in range(layout.world_size))
    for sequence in sequences:
        owned: set[str] = set()
        for part in sequence:
            copies = len(layout.part_ranks(part))
            bucket_bytes = step_bucket_bytes_of(problem.tiers, problem.backend, copies)
            if bucket_bytes is None:
                return tuple(worst)
            sharded = problem.tiers.state.zero_stage >= 1 and copies > 1
            elements, shards = [], []  # per parameter this stage steps: its elements here, and of them a shard's
            for name in used[part]:
                if name in owned:
                    continue
                owned.add(name)
                info = graph.parameter(name)
                shard = sharded and len(users[name]) == 1 and len(info.shape) > 0  # tied ones stay whole
                elements.append(shard_numel(info.numel, copies) if shard else info.numel)
                shards.append(shard)
            sizes = [numel * precision.itemsize for numel in elements]
            for bucket in step_buckets(sizes, step_bucket_bytes(sum(sizes))):
                value = bucket_bytes(sum(elements[i] for i in bucket), sum(elements[i] for i in bucket if shards[i]))
                worst[part] = max(worst[part] or 0.0, value)
    return tuple(worst)
