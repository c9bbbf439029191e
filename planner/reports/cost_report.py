"""The per-layer cost table people read: one row per node, then totals."""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.estimation import CostTable
from cost_models.graph.ir import LayerGraph, NodeKind
from cost_models.units import format_bytes, format_count, format_flops, format_ms

_HIDDEN_KINDS = (NodeKind.PARAM, NodeKind.OUTPUT)


@dataclass(frozen=True)
class _Row:
    name: str
    kind: str
    shape: str
    params: str
    flops: str
    fwd: str
    bwd: str
    saved: str


_HEADER = _Row("name", "kind", "output shape", "params", "fwd+bwd FLOP", "fwd", "bwd", "saved act.")


def format_cost_table(graph: LayerGraph, table: CostTable, *, top: int | None = None) -> str:
    """Render ``table`` for ``graph``; ``top`` keeps only the N nodes with the most time."""
    nodes = [node for node in graph if node.kind not in _HIDDEN_KINDS]
    if top is not None:
        slowest = sorted(nodes, key=lambda n: table[n.name].fwd_ms + table[n.name].bwd_ms, reverse=True)
        keep = {node.name for node in slowest[:top]}
        nodes = [node for node in nodes if node.name in keep]
    rows = [_HEADER] + [_row(graph, table, node.name) for node in nodes]
    widths = [max(len(getattr(row, field)) for row in rows) for field in _Row.__dataclass_fields__]
    lines = [_line(row, widths) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("-" * len(lines[0]))
    lines.extend(_totals(graph, table, len(nodes)))
    return "\n".join(lines)


def _row(graph: LayerGraph, table: CostTable, name: str) -> _Row:
    node, cost = graph.node(name), table[name]
    shape = "x".join(str(d) for d in node.output_shape) if node.output_shape is not None else "-"
    params = graph.owned_param_numel[name]
    return _Row(name, node.op_type, shape, format_count(params) if params else "",
                format_flops(cost.fwd_flops + cost.bwd_flops) if cost.fwd_flops else "",
                format_ms(cost.fwd_ms), format_ms(cost.bwd_ms),
                format_bytes(cost.saved_activation_bytes) if cost.saved_activation_bytes else "")


def _line(row: _Row, widths: list[int]) -> str:
    cells = list(vars(row).values())
    left = cells[:3]
    right = cells[3:]
    parts = [cell.ljust(width) for cell, width in zip(left, widths[:3])]
    parts += [cell.rjust(width) for cell, width in zip(right, widths[3:])]
    return "  ".join(parts).rstrip()


def _totals(graph: LayerGraph, table: CostTable, shown: int) -> list[str]:
    state = table.total("param_bytes") + table.total("grad_bytes") + table.total("optimizer_bytes")
    return [
        f"nodes: {len(graph)} ({shown} shown)   tracer: {graph.tracer}   fingerprint: {graph.fingerprint[:16]}",
        f"parameters: {format_count(graph.param_count)} ({format_bytes(table.total('param_bytes'))} "
        f"as {table.precision}); model state with {table.optimizer}: {format_bytes(state)}",
        f"FLOPs per step: forward {format_flops(table.total('fwd_flops'))}, "
        f"backward {format_flops(table.total('bwd_flops'))}",
        f"time per step on {table.device} ({table.source}): forward {format_ms(table.total('fwd_ms'))}, "
        f"backward {format_ms(table.total('bwd_ms'))}",
        f"activations saved for backward: {format_bytes(table.total('saved_activation_bytes'))}",
    ]
