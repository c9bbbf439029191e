"""The error for a budget no plan fits: the binding stage's memory, by kind, and the fix that helps.

The budget named is one that fits with every activation kept (in the most frugal layout and state
mode): recompute and swap may fit in less, but no smaller figure is certain; beside it, where the search may
recompute or swap, the error names the floor no plan fits below (each decision at its most frugal: a
user told 192.4 MiB for ResNet-50's batch of 64 on 2 V100s, where 150 MB fits, is told too that nothing fits
below 115.9 MiB). Where the GPUs could hold
that layout (keeping every activation, or with the memory decisions its ILP makes were host memory and NVMe
unbounded) but a node's host memory or NVMe cannot hold what it puts there, the error names that instead. A stage's memory is
its model state (weights, gradients, optimizer state, buffers), its working memory (the largest
transient: one node's output and its gradient; the buffer of what it sends),
and its activations (saved activations and received inputs, per micro-batch in flight). Each is
read off the cost terms of planner/search/terms.py with the evaluator: nothing is recomputed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cost_models.errors import PlanInfeasible
from cost_models.units import format_bytes, plural
from planner.budget import Reserve
from planner.search.evaluate import Evaluation, row_value, segments, split_term, term_value
from planner.search.oracle import min_peak_partition

if TYPE_CHECKING:
    from planner.search.search import Setup


@dataclass(frozen=True)
class StageMemory:
    """One stage's peak memory by kind (bytes), on its part's units ``first..last``."""

    state_bytes: float
    transient_bytes: float
    transient_node: str
    send_bytes: float
    activation_bytes: float  # per micro-batch in flight
    in_flight: int
    step_bytes: float = 0.0  # at the optimizer step: what it allocates on top of the model state
    tied_bytes: float = 0.0  # at a backward's end: tied weights' partial gradients and their sum
    accumulating_bytes: float = 0.0  # working set of a backward adding into existing gradients
    accumulating_in_flight: int = 0  # micro-batches held then (0: no such backward)
    split_kept_bytes: float = 0.0  # per micro-batch whose split backward's W waits: what its I kept for it
    waiting: int = 0  # micro-batches whose W waits, at most at once (after an I)
    waiting_at_transient: int = 0  # of those, the most when a forward or an I starts
    weight_grad_working_bytes: float = 0.0  # a W's working set: the most one weighted node's W allocates

    @property
    def held_bytes(self) -> float:
        """The micro-batches' activations in flight, and what split backwards' I keep for their W."""
        return self.in_flight * self.activation_bytes + self.waiting * self.split_kept_bytes

    @property
    def working_bytes(self) -> float:
        return self.transient_bytes + self.send_bytes

    @property
    def compute_bytes(self) -> float:
        """The peak of the forwards and backwards."""
        return (self.state_bytes + self.working_bytes + self.in_flight * self.activation_bytes
                + self.waiting_at_transient * self.split_kept_bytes)

    @property
    def split_bytes(self) -> float:
        """Once a split backward's I ended: every W waiting, a W's working set in place of the transient."""
        if not self.waiting:
            return 0.0
        return self.state_bytes + self.send_bytes + self.weight_grad_working_bytes + self.held_bytes

    @property
    def summing_bytes(self) -> float:
        """At a backward's end: its micro-batch's activations gone, tied gradients being summed."""
        if not self.tied_bytes:
            return 0.0
        return self.state_bytes + self.working_bytes + self.held_bytes + self.tied_bytes - self.activation_bytes

    @property
    def adding_bytes(self) -> float:
        """In a backward adding into existing gradients: its working set in place of the transient."""
        if not self.accumulating_in_flight:
            return 0.0
        return (self.state_bytes + self.send_bytes + self.accumulating_bytes
                + self.accumulating_in_flight * self.activation_bytes + self.waiting * self.split_kept_bytes)

    @property
    def total_bytes(self) -> float:
        return max(self.compute_bytes, self.summing_bytes, self.adding_bytes, self.split_bytes,
                   self.state_bytes + self.step_bytes)

    def describe(self) -> str:
        text = (f"{format_bytes(self.state_bytes)} of model state (weights, gradients, optimizer state, "
                f"buffers), {format_bytes(self.working_bytes)} of working memory (largest transient "
                f"{format_bytes(self.transient_bytes)}: the output of {self.transient_node} and its "
                f"gradient; send buffer {format_bytes(self.send_bytes)}), "
                f"{format_bytes(self.in_flight * self.activation_bytes)} of activations "
                f"({plural(self.in_flight, 'micro-batch', 'micro-batches')} in flight x "
                f"{format_bytes(self.activation_bytes)})")
        if self.waiting and self.split_kept_bytes:
            text += (f", {format_bytes(self.waiting * self.split_kept_bytes)} of output gradients a split backward "
                     f"keeps for its weight gradients ({plural(self.waiting, 'micro-batch', 'micro-batches')} "
                     f"waiting x {format_bytes(self.split_kept_bytes)})")
        moments = (self.compute_bytes, self.summing_bytes, self.adding_bytes, self.split_bytes)
        if self.state_bytes + self.step_bytes > max(moments):
            text += (f"; its peak is the optimizer step, which adds {format_bytes(self.step_bytes)} (a bucket of "
                     f"gradients in the masters' dtype and the optimizer's temporaries) to the model state")
        elif self.split_bytes > max(self.compute_bytes, self.summing_bytes, self.adding_bytes):
            text += (f"; its peak follows a split backward's input gradient, with every weight gradient waiting "
                     f"(a W's working set {format_bytes(self.weight_grad_working_bytes)} in place of the transient)")
        elif self.summing_bytes > max(self.compute_bytes, self.adding_bytes):
            text += (f"; its peak is the end of a backward, where tied weights' partial gradients and their sum "
                     f"({format_bytes(self.tied_bytes)} beyond the gradient) are held with one micro-batch fewer")
        elif self.adding_bytes > self.compute_bytes:
            text += (f"; its peak is a backward adding into the gradients, whose working set is "
                     f"{format_bytes(self.accumulating_bytes)} (a node's output gradient and its new weight "
                     f"gradients) with {plural(self.accumulating_in_flight, 'micro-batch', 'micro-batches')} held")
        return text

    def fix(self) -> str:
        """What to change, by the kind of memory that dominates."""
        kinds = {"state": self.state_bytes, "working": self.working_bytes,
                 "activations": self.held_bytes}
        largest = max(kinds, key=lambda kind: kinds[kind])
        if largest == "state":
            return "more GPUs (more pipeline stages split the model state)"
        if largest == "working":
            return (f"a smaller micro-batch or input ({self.transient_node}'s output is one tensor that "
                    f"more GPUs cannot split)")
        return "a smaller batch or micro-batch (fewer activations in flight), or more GPUs"


def stage_memory(setup: Setup, part: int, stage: int, first: int, last: int) -> StageMemory:
    """``part``'s memory on units ``first..last`` as ``stage`` holds it, by kind, from its cost terms."""
    costs = setup.costs
    static = split_term(costs.parts[part]["static_bytes"])
    value = {name: term_value(costs, term, first, last) for name, term in static.items()}
    transient_unit = max(range(first, last + 1), key=lambda unit: static["transient"].unit_max[unit])
    node = max(setup.coarsening.units[transient_unit].nodes, key=lambda name: setup.table[name].output_bytes)
    return StageMemory(value["held"], value["transient"], node, value["outgoing"],
                       term_value(costs, costs.parts[part]["activation_bytes"], first, last),
                       setup.problem.in_flight[stage],
                       term_value(costs, costs.parts[part]["state_bytes"].plus(costs.parts[part]["step_bytes"]),
                                  first, last) - value["held"],
                       term_value(costs, costs.parts[part]["tied_bytes"], first, last),
                       term_value(costs, costs.parts[part]["accumulate_bytes"], first, last),
                       setup.problem.accumulating[stage] if setup.problem.accumulating else 0,
                       *_split(setup, part, stage, first, last))


def _split(setup: Setup, part: int, stage: int, first: int, last: int) -> tuple[float, int, int, float]:
    """A stage splitting its backward: what its I keeps for its W per micro-batch, the Ws waiting at most and
    when a forward or an I starts, a W's working set (all 0 elsewhere and on the first part: memory rows)."""
    problem, terms = setup.problem, setup.costs.parts[part]
    if not (problem.waiting and problem.waiting[stage] and part > 0):
        return 0.0, 0, 0, 0.0
    return (term_value(setup.costs, terms["split_kept_bytes"], first, last), problem.waiting[stage],
            problem.waiting_at_transient[stage], term_value(setup.costs, terms["weight_grad_working_bytes"], first,
                                                            last))


def infeasible_error(setup: Setup, budget: str, gpus: int, device_name: str,
                     reserve: Reserve, decided_floor_bytes: int | None = None) -> PlanInfeasible:
    """``setup`` is the most memory-frugal configuration's; its best partition's fullest stage is named.
    ``decided_floor_bytes``: the least any configuration needs with recompute and swap at their most frugal
    (where the search may decide them), said beside the budget that certainly fits."""
    costs = setup.costs
    frugal = min_peak_partition(costs)
    lowest = frugal.evaluation
    peaks = [0.0] * len(lowest.slot_peak_bytes)  # per slot, its largest row (its compute or its step)
    for row in costs.frugal_memory:
        peaks[row.slot] = max(peaks[row.slot], row_value(costs, row, segments(costs.num_units, frugal.cuts)))
    stage = max(range(len(peaks)), key=lambda index: peaks[index])
    part = setup.schedule.layout.part(stage)
    summary = lowest.parts[part]
    memory = stage_memory(setup, part, stage, summary.first_unit, summary.last_unit)
    need = round(peaks[stage])
    units = setup.coarsening.units[summary.first_unit:summary.last_unit + 1]
    nodes = [name for unit in units for name in unit.nodes]
    give = reserve.mem_for(need)
    less = ""
    if decided_floor_bytes is not None and reserve.mem_for(decided_floor_bytes) < give:
        less = (f" (it fits keeping every activation; recomputing and swapping them may fit in less, though not "
                f"below {format_bytes(reserve.mem_for(decided_floor_bytes))})")
    message = (f"no plan fits {budget} per GPU on {gpus} x {device_name}: the most memory-frugal layout "
               f"({setup.config.describe()}) still needs {format_bytes(need)} on stage {stage} (nodes "
               f"{nodes[0]} .. {nodes[-1]}): {memory.describe()}. Give mem >= {format_bytes(give, at_least=True)}"
               f"{less}, or {memory.fix()}.")
    return PlanInfeasible(message, min_mem_bytes=give, binding=f"stage {stage} ({nodes[0]})")


def capacity_error(setup: Setup, frugal: Evaluation, kept_bytes: int) -> PlanInfeasible:
    """The error when the GPUs could hold the most frugal plan (``frugal``: its partition, every activation kept
    or, where the GPUs need ``kept_bytes`` for that beyond the budget, with memory decisions) but a node's host
    memory or NVMe cannot (its optimizer state, gradients on the host and swapped activations), naming the
    fullest of them."""
    used = {name: (need, have) for name, need, have in frugal.capacity_bytes}
    name = max(used, key=lambda row: used[row][0] / max(1, used[row][1]))
    need, have = used[name]
    what, flag = ("host memory", "--host-mem (plan(host_mem=))") if name.startswith("host") else (
        "NVMe", "--nvme (plan(nvme=))")
    node = name.rsplit("_", 1)[-1]
    held = (f"{setup.config.describe()}, if it recomputes or swaps activations (it needs {format_bytes(kept_bytes)} "
            f"per GPU keeping them all)" if frugal.decisions is not None else setup.config.describe())
    message = (f"no plan fits: the GPUs could hold {held}, but node {node} would need "
               f"{format_bytes(need)} of {what} for optimizer state and offloaded activations and has "
               f"{format_bytes(have)}; give {flag} >= {format_bytes(need, at_least=True)}, allow another tier, or use more GPUs")
    return PlanInfeasible(message, min_mem_bytes=frugal.peak_mem_bytes, binding=f"{what} of node {node}")
