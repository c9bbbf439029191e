"""Evaluate a partition on a CostModel: any term on any part in O(1), alone or for many parts at once.

A term's value (planner/search/terms.py) is computed in two forms of the same arithmetic: one part
(plain Python, for evaluating partitions and the Pareto DP) and one last unit with many first
units (numpy, for the memory-floor DP); tests/unit/test_partition.py checks they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.plan.parts import OffloadSpec
from planner.search.problem import block_of
from planner.search.terms import (
    BREAKDOWN,
    Aggregate,
    CapacityRow,
    CostModel,
    Drain,
    MemoryRow,
    Reduce,
    Term,
)


@dataclass(frozen=True)
class Decisions:
    """A partition's activation decisions: per unit, the share of its saved activations recomputed
    and the share swapped to the host (0..1)."""

    recompute: tuple[float, ...]
    swap: tuple[float, ...]

    @property
    def is_none(self) -> bool:
        return not (any(self.recompute) or any(self.swap))


def term_matrix(model: CostModel, term: Term) -> np.ndarray:
    """The term's value for a part holding units first..last, at [first, last] for every first <= last
    (entries with first > last, a cut after the last unit or before the first, are meaningless)."""
    return weighted_matrix(model, ((term, 1.0),))


def weighted_matrix(model: CostModel, weighted: Sequence[tuple[Term, float]], firsts: range | None = None,
                    lasts: range | None = None) -> np.ndarray:
    """``sum(weight * term_matrix(model, term))`` over ``weighted``: the linear parts of the terms summed
    per unit first, so a part's many terms cost one matrix (and one per maximum over units). Given
    ``firsts`` and ``lasts`` (ranges of units), only that block of it: at [i, j] the part from unit
    ``firsts[i]`` to unit ``lasts[j]``."""
    count = model.num_units
    firsts, lasts = range(count) if firsts is None else firsts, range(count) if lasts is None else lasts
    first, last = np.arange(firsts.start, firsts.stop)[:, None], np.arange(lasts.start, lasts.stop)[None, :]
    constant, prefix, ends_after, starts_after, shared = 0.0, 0.0, 0.0, 0.0, 0.0  # arrays once a term has them
    maxima: list[tuple[np.ndarray, float]] = []
    for term, weight in weighted:
        constant += weight * term.constant
        unit_prefix, ends, starts, per_shared, unit_max = term.arrays
        if unit_prefix is not None:
            prefix = prefix + weight * unit_prefix
        if ends is not None:
            ends_after = ends_after + weight * ends
        if starts is not None:
            starts_after = starts_after + weight * starts
        if per_shared is not None:
            shared = shared + weight * per_shared
        if unit_max is not None:
            maxima.append((unit_max, weight))
    values = np.full((len(firsts), len(lasts)), constant)
    if isinstance(prefix, np.ndarray):
        values += prefix[last + 1] - prefix[first]
    if isinstance(ends_after, np.ndarray):
        values += ends_after[last]
    if isinstance(starts_after, np.ndarray):
        values += starts_after[first]
    if isinstance(shared, np.ndarray):
        for coefficient, next_use in zip(shared, model.next_use_arrays):
            if coefficient:
                values += np.where(next_use[first] <= last, coefficient, 0.0)
    if maxima:  # row i: the running maximum from unit firsts[i] on (0 before it), over the units the block spans
        spanned = np.arange(firsts.start, max(lasts.stop, firsts.start + 1))[None, :]
        inside = spanned >= first
        held = (last >= first)
        columns = np.maximum(last[0] - firsts.start, 0)  # where the block's lasts are in the span (0: not parts)
        for unit_max, weight in maxima:
            running = np.maximum.accumulate(np.where(inside, unit_max[None, spanned[0]], -np.inf), axis=1)
            values += weight * np.where(held, running[:, columns], 0.0)
    return values


def region_start(decisions: Decisions, unit: int, first: int) -> float:
    """The share of ``unit`` that starts a checkpoint region on a part starting at unit ``first``."""
    share = decisions.recompute[unit]
    if unit > first and block_of(unit - 1) == block_of(unit):
        return max(0.0, share - decisions.recompute[unit - 1])
    return share


def term_value(model: CostModel, term: Term, first: int, last: int, decisions: Decisions | None = None) -> float:
    """The term's value for a part holding units ``first..last`` (its units' decisions as given)."""
    value = term.constant
    if decisions is not None and term.decides:
        units = range(first, last + 1)
        value += sum(term.per_recompute[i] * decisions.recompute[i] for i in units if term.per_recompute)
        value += sum(term.per_swap[i] * decisions.swap[i] for i in units if term.per_swap)
        value += sum(term.per_start[i] * region_start(decisions, i, first) for i in units if term.per_start)

    if term.per_unit:
        value += term.unit_prefix[last + 1] - term.unit_prefix[first]
    if term.ends_after:
        value += term.ends_after[last]
    if term.starts_after:
        value += term.starts_after[first - 1]
    for coefficient, next_use in zip(term.per_shared, model.shared_next_use):
        if coefficient and next_use[first] <= last:
            value += coefficient
    if term.unit_max:
        value += term.max_over(first, last)
    return value


def split_term(term: Term) -> dict[str, Term]:
    """A term as the sum of its kinds of coefficient, each a term: ``held`` (constant, per unit, per
    shared parameter), its maximum over units (named by ``term.max_name``), ``outgoing`` and
    ``incoming`` (its cuts). Their term_values add up to the term's (to say what a total is made of)."""
    return {"held": Term(constant=term.constant, per_unit=term.per_unit, per_shared=term.per_shared),
            term.max_name: Term(unit_max=term.unit_max, max_name=term.max_name),
            "outgoing": Term(ends_after=term.ends_after), "incoming": Term(starts_after=term.starts_after)}


@dataclass(frozen=True)
class PartSummary:
    """One part's costs (the BREAKDOWN terms) for the units it holds."""

    first_unit: int
    last_unit: int
    fwd_ms: float
    bwd_ms: float  # recomputation included
    send_ms: float  # forward transfer across the cut after this part
    allreduce_ms: float
    grad_bytes: int
    static_bytes: int  # held all step: model state, transient, send buffer
    activation_bytes: int  # per micro-batch in flight: kept saved activations + received inputs
    optimizer_ms: float = 0.0  # the optimizer step (on the device or the host), after the all-reduce
    swap_ms: float = 0.0  # per micro-batch, each way over the host link
    swap_bytes: int = 0  # per micro-batch, saved activations swapped to the host
    recompute_bytes: int = 0  # the largest recomputed unit's activations, rematerialised in its backward
    host_bytes: int = 0  # host memory for this part's optimizer state and gradients (per rank)
    nvme_bytes: int = 0  # NVMe for this part's optimizer state (per rank)
    weight_grad_ms: float = 0.0  # what a split backward's W takes: the parameters' gradients
    state_bytes: int = 0  # of static_bytes: the model state on the device
    step_bytes: int = 0  # what the optimizer step allocates on top of the model state, at its worst bucket
    tied_bytes: int = 0  # at a backward's end, tied weights' partial gradients and their sum, before it is added
    accumulate_bytes: int = 0  # in a backward adding into the gradients: its working set (new weight gradients)
    transient_bytes: int = 0  # of static_bytes: the largest working set of a forward or backward
    split_extra_ms: float = 0.0  # a split backward's I and W beyond bwd_ms (I takes bwd - W + this)
    region_transient_bytes: int = 0  # a node's working set alone (the loss's excluded): at a region's backward
    summing_transient_bytes: int = 0  # the working set of a node summing tied weights' partial gradients
    split_kept_bytes: int = 0  # per micro-batch whose split backward's W waits: what its I kept for it
    weight_grad_working_bytes: int = 0  # a W's working set: the most one weighted node's W allocates

    @property
    def compute_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def held_bytes(self) -> int:
        """What the part holds all step beside its activations, at the worse of two moments: its static
        bytes (with the largest transient), or in a recomputed region's backward its static bytes with a
        node's working set in place of the largest transient and the region's activations (the simulator's
        static bytes)."""
        regional = self.region_transient_bytes + self.recompute_bytes
        return max(self.static_bytes, self.static_bytes - self.transient_bytes + regional)

    @property
    def step_excess_bytes(self) -> int:
        """How far the optimizer step's memory (model state and step buffers, nothing else) rises above
        what the part holds all step (:attr:`held_bytes`): the simulator's step event."""
        return max(0, self.state_bytes + self.step_bytes - self.held_bytes)

    @property
    def tied_excess_bytes(self) -> int:
        """What a backward's end, summing tied weights' partial gradients beside the working set of the node
        summing them (the earliest user's) and a recomputed region's activations, adds to :attr:`held_bytes`
        with one micro-batch fewer held: the simulator's tied event, as the memory row's "backward" moment
        counts it."""
        kept = self.static_bytes - self.transient_bytes  # model state, send and receive buffers
        return max(0, kept + self.summing_transient_bytes + self.recompute_bytes + self.tied_bytes - self.held_bytes)

    @property
    def split_relief_bytes(self) -> int:
        """What :attr:`held_bytes` holds beyond a split backward's W's working set: the largest transient, gone
        once the I ended, less the most a weighted node's W allocates; the simulator's split events, as
        the memory row's "split" moment counts it (a split backward does not recompute: planner/search/search.py)."""
        kept = self.static_bytes - self.transient_bytes + self.weight_grad_working_bytes
        return max(0, self.held_bytes - kept)

    @property
    def accumulate_excess_bytes(self) -> int:
        """How far a backward adding into the gradients works above the transient static_bytes counts."""
        return max(0, self.accumulate_bytes - self.transient_bytes)


@dataclass(frozen=True)
class Evaluation:
    """A partition's parts, each slot's peak memory and the step time."""

    cuts: tuple[int, ...]
    parts: tuple[PartSummary, ...]
    slot_peak_bytes: tuple[int, ...]
    step_ms: float
    decisions: Decisions | None = None  # None: everything kept on the GPU
    capacity_bytes: tuple[tuple[str, int, int], ...] = ()  # (row, used, capacity): each node's host and NVMe
    forced: tuple[OffloadSpec, ...] = ()  # per part, decisions a user forced (plan_with_split)

    @property
    def capacity_fits(self) -> bool:
        return all(used <= capacity for _, used, capacity in self.capacity_bytes)

    def fits(self, mem_bytes: int) -> bool:
        return self.peak_mem_bytes <= mem_bytes

    @property
    def peak_mem_bytes(self) -> int:
        return max(self.slot_peak_bytes)


def segments(num_units: int, cuts: tuple[int, ...]) -> list[tuple[int, int]]:
    """Cuts (unit indices after which a part ends) to inclusive (first, last) unit ranges."""
    starts = (0, *(cut + 1 for cut in cuts))
    ends = (*cuts, num_units - 1)
    return list(zip(starts, ends))


def evaluate(model: CostModel, cuts: tuple[int, ...], decisions: Decisions | None = None) -> Evaluation:
    """Evaluate the partition whose part s ends after unit ``cuts[s]``, with ``decisions`` (default none)."""
    if len(cuts) != model.num_parts - 1 or list(cuts) != sorted(set(cuts)) or (
            cuts and not 0 <= cuts[0] <= cuts[-1] < model.num_units - 1):
        raise ValueError(f"cuts {cuts} must be {model.num_parts - 1} increasing unit indices "
                         f"below {model.num_units - 1}")
    if decisions is not None and decisions.is_none:
        decisions = None
    ranges = segments(model.num_units, cuts)
    parts = tuple(_summary(model, part, first, last, decisions) for part, (first, last) in enumerate(ranges))
    peaks = [0] * len({row.slot for row in model.memory})
    for row in model.memory:  # a slot's peak: the largest of its rows (its forwards and backwards, its step)
        peaks[row.slot] = max(peaks[row.slot], round(row_value(model, row, ranges, decisions)))
    step = sum(piece_value(model, piece, ranges, decisions) for piece in model.objective)
    capacity = tuple((row.name, round(capacity_value(model, row, ranges, decisions)), row.capacity_bytes)
                     for row in model.capacity)
    return Evaluation(tuple(cuts), parts, tuple(peaks), step, decisions, capacity)


def piece_value(model: CostModel, piece: Aggregate | Drain, ranges: list[tuple[int, int]],
                decisions: Decisions | None = None) -> float:
    """One piece of the objective (weighted) for the parts' unit ranges."""
    if isinstance(piece, Drain):
        return piece.weight * _drain(model, piece, ranges, decisions)
    values = [term_value(model, term, *ranges[part], decisions) for part, term in piece.members]
    if not values:
        return 0.0
    return piece.weight * (sum(values) if piece.reduce is Reduce.SUM else max(values))


def _drain(model: CostModel, drain: Drain, ranges: list[tuple[int, int]], decisions: Decisions | None) -> float:
    """max over s of (flow summed over parts >= s) + pace_weight x (pace over parts >= s) + tail(s)."""
    per_part = [[0.0, 0.0, 0.0] for _ in ranges]  # flow, pace, tail
    for slot, members in ((0, drain.flow), (1, drain.pace), (2, drain.tail)):
        for part, term in members:
            value = term_value(model, term, *ranges[part], decisions)
            held = per_part[part][slot]
            per_part[part][slot] = max(held, value) if slot == 1 else held + value
    best, flow, pace = float("-inf"), 0.0, 0.0
    for part_flow, part_pace, tail in reversed(per_part):
        flow, pace = flow + part_flow, max(pace, part_pace)
        best = max(best, flow + drain.pace_weight * pace + tail)
    return best


def row_value(model: CostModel, row: MemoryRow, ranges: list[tuple[int, int]],
              decisions: Decisions | None = None) -> float:
    return sum(term_value(model, term, *ranges[part], decisions) for part, term in row.members)


def capacity_value(model: CostModel, row: CapacityRow, ranges: list[tuple[int, int]],
                   decisions: Decisions | None = None) -> float:
    return sum(weight * term_value(model, member, *ranges[part], decisions)
               for part, weight, member in row.members)


def _summary(model: CostModel, part: int, first: int, last: int, decisions: Decisions | None) -> PartSummary:
    values = {name: term_value(model, model.parts[part][name], first, last, decisions)
              for name in BREAKDOWN}
    return PartSummary(first, last, values["fwd_ms"], values["bwd_ms"], values["send_ms"],
                       values["allreduce_ms"], round(values["grad_bytes"]), round(values["static_bytes"]),
                       round(values["activation_bytes"]), values["optimizer_ms"], values["swap_ms"],
                       round(values["swap_bytes"]), round(values["recompute_bytes"]),
                       round(values["host_bytes"]), round(values["nvme_bytes"]), values["weight_grad_ms"],
                       round(values["state_bytes"]), round(values["step_bytes"]), round(values["tied_bytes"]),
                       round(values["accumulate_bytes"]), round(values["transient_bytes"]),
                       values["split_extra_ms"], round(values["region_transient_bytes"]),
                       round(values["summing_transient_bytes"]), round(values["split_kept_bytes"]),
                       round(values["weight_grad_working_bytes"]))
